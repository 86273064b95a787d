"""The se_e2_a energy model: descriptor, fitting net, energy model and its statistics."""

from mdtrain.model.energy import EnergyModel

__all__ = ["EnergyModel"]
