"""The form of a model that ``torch.export`` traces (``mdtrain freeze -o model.pt2``).

A few parts take fast paths whose sizes are read from the inputs' values: se_atten's
attention runs on a window of the most real slots of any centre (`AttentionStack`), se_e3
sums each type block up to its last real slot (`DescriptorSeT.block_windows`), se_e3_tebd
over the pairs of real slots (`DescriptorSeE3Tebd.pair_slots`). A program's
sizes are fixed when it is traced or follow the inputs' sizes, never their values, and
``torch.export`` refuses them. Such a part has a method ``for_export()`` returning its form
over every slot: the same parameters, buffers and names, results equal to rounding.
`export_form` builds the model with those once, where the program is made; the maths read
no flag.
"""

from __future__ import annotations

import copy

from torch import nn


def export_form(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every part that has ``for_export()`` in that form."""
    return _exportable(copy.deepcopy(model))


def _exportable(module: nn.Module) -> nn.Module:
    make = getattr(module, "for_export", None)
    if callable(make):
        module = make()
    for name, child in list(module.named_children()):
        new = _exportable(child)
        if new is not child:
            setattr(module, name, new)
    return module


def recast(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """``module`` as a ``cls``, a subclass of its class that keeps its state and changes how
    it runs (its export form): its parameters, buffers, submodules and attributes, shared."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} is not a {type(module).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    return new
