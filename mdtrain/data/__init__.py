"""Training systems in deepmd/npy and deepmd/hdf5: expansion, lazy frames, type remapping.

No torch here: ``mdtrain neighbor-stat`` and ``mdtrain check`` must start fast.
"""

from mdtrain.data.expand import expand_systems
from mdtrain.data.mixed import open_all, open_systems
from mdtrain.data.system import (
    EXTRA_LABELS,
    LABELS,
    TENSOR_LABELS,
    SetInfo,
    System,
    open_system,
)
from mdtrain.data.validate import validate_system

__all__ = [
    "EXTRA_LABELS",
    "TENSOR_LABELS",
    "LABELS",
    "SetInfo",
    "System",
    "expand_systems",
    "open_all",
    "open_system",
    "open_systems",
    "validate_system",
]
