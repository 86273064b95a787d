"""A tiny float64 energy model with autograd forces and the attempt functions the batch
controller's tests drive it with (whole-batch reference gradients, simulated OOMs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mdtrain.train.batch_controller import frame_weights

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class TinyEnergyModel(torch.nn.Module):
    """A per-atom energy from pair distances, forces by autograd (as in the real model)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.w1 = torch.nn.Parameter(torch.randn(1, 6, generator=gen, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.randn(6, 1, generator=gen, dtype=torch.float64))

    def forward(self, coord: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coord = coord.requires_grad_(True)
        r2 = ((coord[:, :, None, :] - coord[:, None, :, :]) ** 2).sum(-1)
        density = torch.exp(-r2).sum(-1, keepdim=True) - 1.0  # the self term is exp(0) = 1
        atom_e = (torch.tanh(density @ self.w1) @ self.w2)[..., 0]
        energy = atom_e.sum(-1)
        (grad,) = torch.autograd.grad(energy.sum(), coord, create_graph=True)
        return energy, -grad


def tiny_loss(model: TinyEnergyModel, coord, e_ref, f_ref) -> torch.Tensor:
    """Mean over frames, like the energy/force loss (one system per batch: equal natoms)."""
    energy, force = model(coord.clone())
    natoms = coord.shape[1]
    le = ((energy - e_ref) / natoms) ** 2
    lf = ((force - f_ref) ** 2).mean(dim=(1, 2))
    return (0.7 * le + 3.0 * lf).mean()


def tiny_batch(nframes: int = 7, natoms: int = 5, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    coord = torch.rand(nframes, natoms, 3, generator=gen, dtype=torch.float64) * 3
    e_ref = torch.randn(nframes, generator=gen, dtype=torch.float64)
    f_ref = torch.randn(nframes, natoms, 3, generator=gen, dtype=torch.float64)
    return coord, e_ref, f_ref


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def accumulating_attempt(
    model: TinyEnergyModel, batch: Batch, fits: Callable[[int], bool] | None = None
) -> Callable[[list[slice]], int]:
    """An ``attempt_fn``: weighted gradient accumulation over the micro-batches; a micro-batch
    of ``n`` frames for which ``fits(n)`` is False raises an OOM after its backward (so a
    failed attempt leaves partial gradients behind). Returns the number of micro-batches."""
    coord, e_ref, f_ref = batch
    nframes = coord.shape[0]

    def attempt(slices: list[slice]) -> int:
        for s, w in zip(slices, frame_weights(slices, nframes), strict=True):
            (w * tiny_loss(model, coord[s], e_ref[s], f_ref[s])).backward()
            if fits is not None and not fits(s.stop - s.start):
                raise oom()
        return len(slices)

    return attempt


def fake_attempt(atoms_fit: int, natoms: int, calls: list[int] | None = None):
    """An ``attempt_fn`` without a model: a micro-batch of more than ``atoms_fit`` atoms runs out
    of memory; ``calls`` records the number of micro-batches of every attempt."""

    def attempt(slices: list[slice]) -> int:
        if calls is not None:
            calls.append(len(slices))
        if max(s.stop - s.start for s in slices) * natoms > atoms_fit:
            raise oom()
        return len(slices)

    return attempt
