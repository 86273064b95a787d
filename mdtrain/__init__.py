"""mdtrain: a trainer for DeePMD-style machine-learned interatomic potentials."""

__version__ = "0.1.0"
