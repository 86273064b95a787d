"""The ASE calculator under a short name: ``from mdtrain.calculator import MDTrainCalculator``.

This is the promised import path for users; the class itself lives in
`mdtrain.infer.calculator` with the rest of inference, and both names are the same object.
"""

from mdtrain.infer.calculator import MDTrainCalculator

__all__ = ["MDTrainCalculator"]
