"""The environment matrix and the force path in compiled code (``csrc/pairs.cpp``): the
``kernels`` backend's versions of ``environment_node`` and ``force_node``, the same values bit
for bit.

Each node's forward (and the force node's backward) was some 20–40 small torch operations on
(M, nnei) arrays, each a pass over memory, most of them below ATen's parallel grain and so run
on one thread; here each is one or two loops over the pairs, split over torch's threads. The
arithmetic is the PyTorch nodes' own, operation by operation; the reductions a torch kernel
vectorises (a row's sum of g over its slots, the virial's products, its backward's product)
stay torch operations, and the force gather sums in pair order as ``index_add_`` does.
Chosen once, where the model is built (``backend.build_model``): the environment carries it
(``ForceInputs.pairs``) to the force node.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from mdtrain.model.accel.descriptor_products import DescriptorProducts
from mdtrain.model.accel.environment_node import RowKind, as_planes, as_rows, normalisation
from mdtrain.model.accel.force_node import ForceInputs, virial_cotangent, virial_of
from mdtrain.model.accel.kernels import OUT_OF_MEMORY, Kernels

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _check(status: int, what: str) -> None:
    """A kernel's status as an exception (``MemoryError`` for an allocation failure, which
    the batch controller recovers from, as for the embedding kernels)."""
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"compiled pair kernels, {what}: out of memory")
    if status != 0:
        raise RuntimeError(f"compiled pair kernels, {what}: status {status}")


def _ptr(t: Tensor | None) -> _P:
    return _P(t.data_ptr() if t is not None else None)


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


class CompiledPairs:
    """The compiled pair kernels of a loaded kernel library."""

    name = "compiled"

    def __init__(self, kernels: Kernels) -> None:
        lib = kernels.lib
        for s in ("f32", "f64"):
            getattr(lib, f"mdt_pair_distance_{s}").argtypes = [
                _I64, _I64, _P, _P, ctypes.c_double, _P, _P, _P, _P, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_pair_environment_{s}").argtypes = [
                _INT, _I64, _I64, _I64, *[_P] * 7, _INT, *[_P] * 4, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_pair_force_forward_{s}").argtypes = [
                _INT, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_pair_force_backward_{s}").argtypes = [
                _INT, _I64, _I64, _I64, *[_P] * 4, _I64, *[_P] * 4, _INT,
            ]  # fmt: skip
        lib.mdt_pair_slot_widths.argtypes = [_I64, _P, _P, _I64, _P, _I64, _P]
        lib.mdt_pair_force_assemble.argtypes = [_I64, _I64, _I64, _P, _P, _P, _P]
        lib.mdt_pair_force_assemble.restype = None
        self.lib = lib
        # se_e2_a's D and dE/dT (``descriptor_products``), used where they give torch's bits
        self.products = DescriptorProducts(kernels)

    def fn(self, name: str, dtype: torch.dtype):
        return getattr(self.lib, f"mdt_pair_{name}_{_suffix(dtype)}")

    def environment(self, desc, kind: RowKind, diff: Tensor, nl: Tensor, types: Tensor,
                    atype: Tensor, ones: bool):  # fmt: skip
        """As ``environment_node.environment_matrix`` followed by appending a column of ones
        (``ones``: se_e2_r's rows) and the rows' transpose: ((rows, columns, far vectors,
        coefficients, scale, float64 pair-vector planes), mask); the planes are the far
        vectors themselves in float64 (as ``explicit_descriptor.kind_environment``'s)."""
        keep = None
        if desc.has_exclusions:
            ntype_j = torch.where(nl >= 0, atype[nl.clamp(min=0)], desc.ntypes)
            keep = desc.pair_keep[types.unsqueeze(-1), ntype_j].contiguous()
        planes = None  # the float64 vectors of a float32 descriptor, filled by the node
        if desc.dtype != torch.float64:
            planes = torch.empty(3, *nl.shape, dtype=torch.float64, device=diff.device)
        out = _CompiledEnvironment.apply(diff, nl, types, keep, desc, kind, ones, self, planes)
        rows, cols, far, coef, scale, mask = out
        return (rows, cols, far, coef, scale, far if planes is None else planes), mask

    def slot_widths(self, desc, mask: Tensor, bounds: list[int]) -> list[list[int]]:
        """As ``environment_node.slot_widths`` (no torch operations, no synchronisation)."""
        groups, ntypes = len(bounds) - 1, desc.ntypes
        widths = (_I64 * (groups * ntypes))()
        offsets = (_I64 * (ntypes + 1))(*desc.offsets[: ntypes + 1])
        status = self.lib.mdt_pair_slot_widths(
            mask.shape[1], _ptr(mask), (_I64 * len(bounds))(*bounds), groups, offsets, ntypes,
            widths,
        )  # fmt: skip
        _check(status, "slot widths")
        return [list(widths[g * ntypes : (g + 1) * ntypes]) for g in range(groups)]

    def forces_and_virial(
        self, inputs: ForceInputs, pieces: list[Tensor], members: int, virial: bool = True
    ):
        """As ``force_node.forces_and_virial``."""
        return _CompiledForcePath.apply(inputs, members, virial, *pieces)


class _CompiledEnvironment(torch.autograd.Function):
    """Rows (M, nnei, A) and their transpose (M, A, nnei) of pair vectors (M, nnei, 3), with
    the far vectors, coefficients, scale and mask (no gradient); the backward is
    ``environment_node``'s (the pull-back) on the rows' first ``width`` columns."""

    @staticmethod
    def forward(ctx, diff, nl, types, keep, desc, kind: RowKind, ones: bool, pairs, planes):
        dtype, device = desc.dtype, diff.device
        m, nnei = nl.shape
        width = 4 if kind.code == 0 else 1
        a = width + int(ones)
        davg, dstd, _, _ = normalisation(desc)  # kept across steps, in dtype
        rows = torch.empty(m, nnei, a, dtype=dtype, device=device)
        cols = torch.empty(m, a, nnei, dtype=dtype, device=device)
        far = torch.empty(3, m, nnei, dtype=dtype, device=device)
        r = torch.empty(m, nnei, dtype=dtype, device=device)
        coef = torch.empty(3 if kind.code == 0 else 1, m, nnei, dtype=dtype, device=device)
        scale = torch.empty(m, nnei, width, dtype=dtype, device=device)
        mask = torch.empty(m, nnei, dtype=torch.bool, device=device)
        vec = diff.to(torch.float64).contiguous()
        threads = torch.get_num_threads()
        nl64, types64 = nl.to(torch.int64).contiguous(), types.to(torch.int64).contiguous()
        status = pairs.fn("distance", dtype)(
            m, nnei, _ptr(vec), _ptr(nl64), desc.rcut, _ptr(far), _ptr(r), _ptr(mask),
            _ptr(planes), threads,
        )  # fmt: skip
        _check(status, "pair distances")
        r.sqrt_()  # torch's (MKL's) square root: not always the correctly rounded one
        consts = (ctypes.c_double * 3)(desc.rcut, desc.rcut_smth, desc.env_protection)
        status = pairs.fn("environment", dtype)(
            kind.code, m, nnei, davg.shape[0], _ptr(far), _ptr(r), _ptr(types64), _ptr(keep),
            _ptr(davg), _ptr(dstd), consts, int(ones), _ptr(rows), _ptr(cols), _ptr(coef),
            _ptr(scale), threads,
        )  # fmt: skip
        _check(status, "environment matrix")
        ctx.kind, ctx.dtype, ctx.width = kind, diff.dtype, width
        ctx.mark_non_differentiable(far, coef, scale, mask)
        ctx.save_for_backward(far, coef, scale)
        return rows, cols, far, coef, scale, mask

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, rows_bar, cols_bar, *_):
        width = ctx.width
        bar = None
        if rows_bar is not None:
            bar = rows_bar[..., :width]
        if cols_bar is not None:
            part = cols_bar[:, :width].transpose(1, 2)
            bar = part if bar is None else bar + part
        far, coef, scale = ctx.saved_tensors  # the pull-back, as the PyTorch node's backward
        grad = as_rows(ctx.kind.pull(as_planes(bar * scale), far, coef)).to(ctx.dtype)
        return grad, *([None] * 8)


def _check_layout(inputs: ForceInputs) -> None:
    if inputs.kind.code not in (0, 1):
        raise RuntimeError("the compiled force path runs se_e2_a and se_e2_r rows only")


class _CompiledForcePath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs: ForceInputs, members: int, virial: bool, *pieces: Tensor):
        _check_layout(inputs)
        plan, pairs = inputs.plan, inputs.pairs
        rows, nnei = plan.centre.shape[0], inputs.far.shape[2]
        flat = plan.nf * plan.natoms
        dtype = pieces[0].dtype
        pieces = tuple(p.contiguous() for p in pieces)
        g = torch.empty(members, 3, rows, nnei, dtype=torch.float64)
        pulled = torch.empty(members, 3, flat, dtype=torch.float64)
        ptrs = (_P * len(pieces))(*[p.data_ptr() for p in pieces])
        counts = (_I64 * len(pieces))(*[p.shape[0] for p in pieces])
        status = pairs.fn("force_forward", dtype)(
            inputs.kind.code, members, rows, nnei, ptrs, counts, len(pieces),
            _ptr(inputs.scale), _ptr(inputs.far), _ptr(inputs.coef), _ptr(plan.neighbour),
            flat, _ptr(g), _ptr(pulled), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "force path")
        own = g.sum(dim=3)  # torch's vectorised sum of each row's slots
        force = torch.empty(members, flat, 3, dtype=torch.float64)
        pairs.lib.mdt_pair_force_assemble(
            members, rows, flat, _ptr(own), _ptr(pulled), _ptr(plan.centre), _ptr(force)
        )
        ctx.inputs, ctx.members, ctx.sizes = inputs, members, [p.shape[0] for p in pieces]
        ctx.dtype = dtype
        ctx.set_materialize_grads(False)
        virials = virial_of(g, inputs) if virial else None  # not read: not made
        return force.view(members, plan.nf, plan.natoms, 3), virials

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, force_bar: Tensor | None, virial_bar: Tensor | None):
        inputs, k = ctx.inputs, ctx.members
        plan = inputs.plan
        rows, nnei = plan.centre.shape[0], inputs.far.shape[2]
        if force_bar is None and virial_bar is None:
            return None, None, None, *([None] * len(ctx.sizes))
        fb = None if force_bar is None else force_bar.reshape(k, -1, 3).contiguous()
        vpart = None if virial_bar is None else virial_cotangent(virial_bar, inputs, k)
        width = inputs.scale.shape[-1]
        out = inputs.far.new_empty(k * rows, nnei, width)
        status = inputs.pairs.fn("force_backward", ctx.dtype)(
            inputs.kind.code, k, rows, nnei, _ptr(fb), _ptr(vpart), _ptr(plan.centre),
            _ptr(plan.neighbour), plan.nf * plan.natoms, _ptr(inputs.far), _ptr(inputs.coef),
            _ptr(inputs.scale), _ptr(out), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "force path backward")
        return None, None, None, *out.split(ctx.sizes)
