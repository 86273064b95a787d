"""A committee: N energy models of one architecture, differing only in their seeds, evaluated
on the same frames (active learning trains them together and measures where they disagree).

Member ``k`` is the model a single run builds from the ``model`` section with
``descriptor.seed`` and ``fitting_net.seed`` increased by ``k`` (`member_model_config`). The
members share no parameters. Their statistics (davg/dstd, energy bias) come from the data only,
so they are equal; the accelerated committee (``mdtrain.model.accel.committee``) relies on
equal davg/dstd to compute the environment matrix once for all members (`stats_shared`).

This reference committee evaluates each member on its own: ``forward`` returns the list of the
members' outputs, each exactly what the member alone returns.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from mdtrain.config.model_kind import network_sections
from mdtrain.model.energy import EnergyModel

SEEDED = ("descriptor", "fitting_net")  # the sections whose ``seed`` differs between members


def member_model_config(model_config: dict, k: int) -> dict:
    """The ``model`` section of member ``k``: the seeds of ``SEEDED`` increased by ``k``
    (a null seed stays null; the training run draws one first)."""
    config = copy.deepcopy(model_config)
    for _, network in network_sections(config):  # a linear_ener model's network parts too
        for section in SEEDED:
            part = network.get(section)
            if part is not None and part.get("seed") is not None:
                part["seed"] = int(part["seed"]) + k
    return config


class Committee(nn.Module):
    """Members evaluated one by one; ``forward`` takes ``EnergyModel``'s inputs and returns
    one output dict per member."""

    backend: str

    def __init__(self, members: list[EnergyModel]) -> None:
        super().__init__()
        if not members:
            raise ValueError("a committee needs at least one member")
        self.members = nn.ModuleList(members)
        self.backend = members[0].backend

    def __len__(self) -> int:
        return len(self.members)

    def forward(self, coord, atype, box, nlist, shift) -> list[dict[str, torch.Tensor]]:
        return [member(coord, atype, box, nlist, shift) for member in self.members]

    def get_model_config(self) -> dict:
        """Member 0's model section (the others differ in their seeds only)."""
        return self.members[0].get_model_config()

    def stats_shared(self) -> bool:
        """Whether every member has member 0's davg and dstd (exactly)."""
        return stats_shared(list(self.members))

    def share_statistics(self) -> None:
        """Copy member 0's davg/dstd and energy bias into every member (statistics depend on
        the data only, so they are computed once)."""
        share_statistics(list(self.members))


def members_of(model: nn.Module) -> list[nn.Module]:
    """A committee's members, or the one model (a single run is a committee of one)."""
    return list(model.members) if isinstance(model, Committee) else [model]


def stats_shared(models: list[nn.Module]) -> bool:
    """Whether every model has the first one's davg and dstd (exactly)."""
    firsts = descriptors_of(models[0])
    return all(
        torch.equal(d.davg, first.davg) and torch.equal(d.dstd, first.dstd)
        for m in models
        for d, first in zip(descriptors_of(m), firsts, strict=True)
    )


def descriptors_of(model: nn.Module) -> list[nn.Module]:
    """The model's descriptor, or a combined model's network parts' descriptors."""
    if hasattr(model, "descriptor"):
        return [model.descriptor]
    return [p.descriptor for p in model.parts if hasattr(p, "descriptor")]


@torch.no_grad()
def share_statistics(models: list[nn.Module]) -> None:
    """Copy the first model's davg/dstd and energy bias into the others."""
    first = models[0]
    for member in models[1:]:
        for mine, theirs in zip(descriptors_of(member), descriptors_of(first), strict=True):
            mine.set_stats(theirs.davg, theirs.dstd)
        member.set_out_bias(first.out_bias, first.out_std)
