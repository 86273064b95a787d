"""``python -m mdtrain`` (and ``torchrun -m mdtrain``) entry point."""

import sys

from mdtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
