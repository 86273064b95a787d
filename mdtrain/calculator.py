"""The ASE calculators under a short name: ``from mdtrain.calculator import MDTrainCalculator``
(one model) and ``CommitteeCalculator`` (a committee: mean and deviation).

This is the promised import path for users; the classes themselves live in
`mdtrain.infer.calculator` with the rest of inference, and both names are the same objects.
"""

from mdtrain.infer.calculator import CommitteeCalculator, MDTrainCalculator

__all__ = ["CommitteeCalculator", "MDTrainCalculator"]
