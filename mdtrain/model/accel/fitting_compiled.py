"""The float32 fitting node on the compiled kernels (``csrc/fitting.cpp``): what
``fitting_types.TypesValueAndInputGrad`` computes (atomic energies, dE/dD and, backward,
dL/dD and every parameter's gradient), in one call each way.

At two threads the PyTorch node spent about half its time outside its products: ~140 ATen
calls a step, Python, elementwise passes, and MKL splitting 64- and 128-row products badly
over two threads. The compiled node splits the rows (both types' together) over torch's
OpenMP threads, each running single-threaded products and fused loops through every layer,
then the weight gradients by output columns. Its float32 roundings differ from the PyTorch
node's in the last bits; float64 models keep the PyTorch node. ``fitting_node_for`` chooses
once, where the model is built.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mdtrain.model.accel.fitting_node import fitting_with_grad
from mdtrain.model.accel.kernels import OUT_OF_MEMORY, Kernels
from mdtrain.model.accel.layout import Layout, layer_layout, layer_params
from mdtrain.model.accel.per_types import kept_per_types
from mdtrain.model.fitting import EnergyFitting

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _ptr(t: Tensor | None) -> ctypes.c_void_p:
    return _P(None if t is None else t.data_ptr())


def _ptrs(tensors) -> ctypes.Array:
    return (_P * len(tensors))(*[t.data_ptr() for t in tensors])


def _check(status: int, what: str) -> None:
    """The node's status as an exception (``MemoryError`` for an allocation failure, which the
    batch controller and the inference chunker recover from)."""
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"compiled fitting node, {what}: std::bad_alloc (out of memory)")
    if status != 0:
        raise RuntimeError(f"compiled fitting node, {what}: status {status}")


class FitRows(NamedTuple):
    """The rows in type order: ``order`` (int64, each row's frame·N + atom), ``counts`` per
    type (a C array), ``covered``: every atom of every frame has a type's net."""

    order: Tensor
    counts: ctypes.Array
    total: int
    covered: bool


def fit_rows(atype: Tensor, ntypes: int, nf: int) -> FitRows:
    """Each type's atoms of all ``nf`` frames, frame-major, type after type."""
    natoms = atype.shape[0]
    frames = torch.arange(nf).mul_(natoms).view(-1, 1)
    groups = [
        (frames + torch.nonzero(atype.cpu() == c).view(1, -1)).view(-1) for c in range(ntypes)
    ]
    order = torch.cat(groups)
    counts = (_I64 * ntypes)(*[len(g) for g in groups])
    return FitRows(order, counts, len(order), len(order) == nf * natoms)


@functools.lru_cache(maxsize=64)
def _layout_args(lib, layout: Layout, n_out: tuple[int, ...]) -> tuple[ctypes.Array, int]:
    """The hidden layers as C ints (n_in, n_out, skip, has idt each) and the tape's floats per
    row (its arrays: ``csrc/fitting.cpp``)."""
    values = []
    for (n_in, skip, has_idt), width in zip(layout, n_out, strict=True):
        values += [n_in, width, skip, int(has_idt)]
    lay = (_INT * len(values))(*values)
    return lay, lib.mdt_fit_tape_per_row(len(layout), lay)


def supported(fitting: EnergyFitting) -> bool:
    """Whether the compiled node runs this fitting: float32, one tanh net per type of one
    layout with at least one hidden layer and a plain (n, 1) output layer."""
    nets = fitting.networks
    if fitting.dtype != torch.float32 or not nets:
        return False
    try:
        layouts = {layer_layout(net.layers[:-1]) for net in nets}
        outs = [net.layers[-1] for net in nets]
    except AttributeError:  # layers other than ResidualLayer
        return False
    if len(layouts) != 1 or not next(iter(layouts)):
        return False
    hidden = nets[0].layers[:-1]
    tanh = all(ly.activation == "tanh" for net in nets for ly in net.layers[:-1])
    plain_out = all(o.n_out == 1 and o.skip == 0 and o.idt is None for o in outs)
    return (
        tanh
        and plain_out
        and all(p.dtype == torch.float32 for p in fitting.parameters())
        and (hidden[0].n_in == fitting.dim_in)
    )


class CompiledFitting:
    """``fitting_with_grad`` on the compiled kernels (float32 CPU tensors)."""

    def __init__(self, kernels: Kernels) -> None:
        lib = kernels.lib
        common = [_INT, _P, _INT, _P, _P, _P]  # layers, lay, types, counts, order, params
        lib.mdt_fit_forward_f32.argtypes = [*common, _P, _P, _P, _P, _INT]
        lib.mdt_fit_backward_f32.argtypes = [*common, _P, _P, _I64, _I64, _I64, _P, _P, _P, _INT]
        lib.mdt_fit_tape_per_row.argtypes = [_INT, _P]
        lib.mdt_fit_tape_per_row.restype = _I64
        self.kernels = kernels

    def __deepcopy__(self, memo):  # holds the loaded library: copies of a model share it
        return self

    def __call__(self, fitting: EnergyFitting, descriptor: Tensor, atype: Tensor):
        nets = fitting.networks
        if descriptor.device.type != "cpu":
            raise RuntimeError(
                "the compiled kernels take CPU tensors: build the model for its device"
            )
        if nets[0].layers[0].weight.dtype != torch.float32:  # cast after it was built
            return fitting_with_grad(fitting, descriptor, atype)
        nf = descriptor.shape[0]
        rows = kept_per_types(
            "fit rows", (len(nets), nf), atype, lambda: fit_rows(atype, len(nets), nf)
        )
        layout = layer_layout(nets[0].layers[:-1])
        params = [p for net in nets for p in layer_params(net.layers)]
        return _CompiledTypes.apply(descriptor.to(torch.float32), self, rows, layout, *params)


class _CompiledTypes(torch.autograd.Function):
    """Atomic energies (nf, N) float64 and dE/dD (nf, N, dim) float32 from D (nf, N, dim)."""

    @staticmethod
    def forward(ctx, descriptor: Tensor, fit: CompiledFitting, rows: FitRows, layout, *params):
        nf, natoms, dim = descriptor.shape
        d = descriptor.contiguous()
        n_out = tuple(params[k].shape[1] for k in _weights(layout))
        kernels = fit.kernels
        lay, per_row = _layout_args(kernels.lib, layout, n_out)
        tape = d.new_empty(rows.total * per_row)
        make = torch.empty if rows.covered else torch.zeros
        energies = make(nf, natoms, dtype=torch.float64)
        grad = make(nf, natoms, dim, dtype=torch.float32)
        status = kernels.lib.mdt_fit_forward_f32(
            len(layout), lay, len(rows.counts), rows.counts, _ptr(rows.order),
            _ptrs(params), _ptr(d), _ptr(tape), _ptr(energies), _ptr(grad),
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "fitting forward")
        ctx.fit, ctx.rows, ctx.layout, ctx.tape, ctx.lay = fit, rows, layout, tape, lay
        ctx.shape = descriptor.shape
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*params)
        return energies, grad

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, energy_bar: Tensor | None, grad_bar: Tensor | None):
        params = ctx.saved_tensors
        rows, layout = ctx.rows, ctx.layout
        flat = params[0].new_empty(sum(p.numel() for p in params))
        d_bar = None
        if ctx.needs_input_grad[0]:  # zeros only for atoms of no type's net
            d_bar = (torch.empty if rows.covered else torch.zeros)(ctx.shape, dtype=torch.float32)
        g_bar = None if grad_bar is None else grad_bar.contiguous()
        e_strides = (0, 0) if energy_bar is None else energy_bar.stride()
        kernels = ctx.fit.kernels
        status = kernels.lib.mdt_fit_backward_f32(
            len(layout), ctx.lay, len(rows.counts), rows.counts, _ptr(rows.order),
            _ptrs(params), _ptr(ctx.tape), _ptr(energy_bar), ctx.shape[1],
            *e_strides, _ptr(g_bar), _ptr(d_bar), _ptr(flat), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "fitting backward")
        parts = flat.split([p.numel() for p in params])
        grads = [g if p.dim() == 1 else g.view(p.shape) for g, p in zip(parts, params, strict=True)]
        if energy_bar is None:  # no energy cotangent: b_out has no gradient (as the PyTorch node)
            per_net = len(params) // len(rows.counts)
            for i in range(per_net - 1, len(params), per_net):
                grads[i] = None
        return (d_bar, None, None, None, *grads)


def _weights(layout: Layout) -> list[int]:
    """Index of each hidden layer's weight in one net's parameters."""
    found, k = [], 0
    for _, _, has_idt in layout:
        found.append(k)
        k += 3 if has_idt else 2
    return found


def fitting_node_for(fitting: EnergyFitting, kernels: Kernels | None) -> Callable:
    """The fitting node for a model built with ``kernels`` (None: none compiled): the compiled
    one for a float32 fitting it supports, else the PyTorch ``fitting_with_grad``."""
    if kernels is None or not supported(fitting):
        return fitting_with_grad
    return CompiledFitting(kernels)
