"""The se_e2_a descriptor's small batched products in compiled code (``csrc/products.cpp``):
D = TᵀT< and dE/dT = T< dDᵀ + [T dD, 0] as two autograd nodes, the same bits as torch's.

torch runs each of these (and the six products of their backward) as a batched BLAS product
that handles one (4 × 100)-sized matrix at a time, about 1 µs each: 0.2–0.9 ms per call for
192 centres, eleven calls a step, plus the zero fills and copies of the slices' backward. Here
each node direction is one loop over the centres.

The kernels reproduce the summation order of the BLAS library's kernels (MKL on AVX2: a fused
multiply-add chain over k in the main columns, plain lanes in the last few), which depends on
the library and the CPU; ``DescriptorProducts.orders`` measures it on this machine, per
product, against ``torch.bmm`` on the layouts torch uses, and checks both nodes against the
torch operations (values and gradients, bit for bit). Where no order matches, the descriptor
keeps torch's operations. The gradient of t is handed to autograd in the pieces, and so the
order of sums, that autograd itself forms.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from mdtrain.model.accel.kernels import OUT_OF_MEMORY, Kernels

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_DBL = ctypes.c_double
_WIDTHS = (4, 8, 12, 16, 24, 32)  # candidate widths of the BLAS kernels' main column blocks


def _check(status: int, what: str) -> None:
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"compiled descriptor products, {what}: out of memory")
    if status != 0:
        raise RuntimeError(f"compiled descriptor products, {what}: status {status}")


def _ptr(t: Tensor) -> _P:
    return _P(t.data_ptr())


def _at(orders: ctypes.Array, product: int) -> _P:
    """The orders from the ``product``-th on (two int64 each)."""
    return _P(ctypes.addressof(orders) + 16 * product)


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


def _roles(t: Tensor, dd: Tensor, d_bar: Tensor, g: Tensor, x: int):
    """The nine products of the descriptor's nodes (forward and backward) with the operand
    layouts torch gives them: ``t`` (B, A, M), ``dd``, ``d_bar`` (B, M, X), ``g`` (B, A, M)
    (a cotangent of dE/dT); ``g[..., :x]`` stands for the slice autograd hands on."""
    t_low, b_bar = t[:, :, :x], g[:, :, :x]
    return [
        (t.transpose(1, 2), t_low),  # D
        (t, d_bar),  # D backward: [t dD̄, 0]
        (d_bar, t_low.transpose(1, 2)),  # D backward: dD̄ t<ᵀ
        (t_low, dd.transpose(1, 2)),  # dE/dT: t< dDᵀ
        (t, dd),  # dE/dT: t dD
        (g, dd),  # its backward: ā dD
        (t_low.transpose(1, 2), g),  # t<ᵀ ā
        (b_bar, dd.transpose(1, 2)),  # b̄ dDᵀ
        (t.transpose(1, 2), b_bar),  # tᵀ b̄
    ]


class DescriptorProducts:
    """The compiled products of a loaded kernel library, with the summation orders measured
    once per dtype and shape."""

    def __init__(self, kernels: Kernels) -> None:
        lib = kernels.lib
        for s in ("f32", "f64"):
            getattr(lib, f"mdt_small_product_{s}").argtypes = [
                *[_I64] * 4, _P, *[_I64] * 3, _P, *[_I64] * 3, _P, _I64, _I64, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_descriptor_forward_{s}").argtypes = [
                *[_I64] * 4, _P, _DBL, _P, _P, _P, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_descriptor_backward_{s}").argtypes = [
                *[_I64] * 4, _P, _P, _P, _DBL, _P, _P, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_tbar_forward_{s}").argtypes = [
                *[_I64] * 4, _P, _P, _DBL, _P, _P, _INT,
            ]  # fmt: skip
            getattr(lib, f"mdt_tbar_backward_{s}").argtypes = [
                *[_I64] * 4, _P, _P, _P, _DBL, _P, _P, _P, _INT,
            ]  # fmt: skip
        self.lib = lib
        self._orders: dict[tuple, ctypes.Array | None] = {}

    def fn(self, name: str, dtype: torch.dtype):
        return getattr(self.lib, f"mdt_{name}_{_suffix(dtype)}")

    def product(self, a: Tensor, b: Tensor, split: int, lanes: int) -> Tensor:
        """``torch.bmm(a, b)`` summed in the order (split, lanes) (see ``csrc/products.cpp``)."""
        batch, m, k = a.shape
        n = b.shape[2]
        c = a.new_empty(batch, m, n)
        status = self.fn("small_product", a.dtype)(
            batch, m, n, k, _ptr(a), *a.stride(), _ptr(b), *b.stride(), _ptr(c), split, lanes,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "product")
        return c

    def _match(self, a: Tensor, b: Tensor) -> tuple[int, int] | None:
        """The first (split, lanes) whose product equals ``torch.bmm`` bit for bit."""
        want = torch.bmm(a, b)
        n, k = b.shape[2], b.shape[1]
        splits = sorted({n} | {n - n % w for w in _WIDTHS}, reverse=True)
        for split in splits:
            for lanes in (1, 2, 4) if split < n else (1,):
                if lanes <= k and torch.equal(self.product(a, b, split, lanes), want):
                    return split, lanes
        return None

    def orders(self, dtype: torch.dtype, rows: int, m: int, x: int) -> ctypes.Array | None:
        """The nine products' orders (split, lanes each) for T (·, rows, m) and axis ``x`` in
        ``dtype``, measured on random operands and checked on both nodes; None where torch's
        order is not reproduced (then the descriptor keeps torch's operations)."""
        key = (dtype, rows, m, x)
        if key not in self._orders:
            with torch.inference_mode(False), torch.enable_grad():  # an eval may call first
                self._orders[key] = self._measure(dtype, rows, m, x)
        return self._orders[key]

    def _measure(self, dtype: torch.dtype, rows: int, m: int, x: int) -> ctypes.Array | None:
        if dtype not in (torch.float32, torch.float64) or not 0 < x <= m:
            return None
        gen = torch.Generator().manual_seed(27)
        t, g = (torch.randn(24, rows, m, dtype=dtype, generator=gen) for _ in range(2))
        dd, d_bar = (torch.randn(24, m, x, dtype=dtype, generator=gen) for _ in range(2))
        found = [self._match(a, b) for a, b in _roles(t, dd, d_bar, g, x)]
        if any(f is None for f in found):
            return None
        orders = (_I64 * 18)(*[v for f in found for v in f])  # type: ignore[union-attr]
        return orders if _nodes_match(self, orders, t, dd, d_bar, g, x) else None

    def descriptor_of_sum(self, desc, s: Tensor) -> tuple[Tensor, Tensor]:
        """D (B, M·X) and T/nnei (B, A, M) from the contraction's sum T (B, A, M), as
        ``desc.descriptor_of_t(T / nnei)`` (torch's operations where the products were not
        measured to match)."""
        orders = self.orders(s.dtype, s.shape[1], s.shape[2], desc.axis_neuron)
        if orders is None:
            t = s / desc.nnei
            return torch_descriptor_of_t(t, desc.axis_neuron), t
        return _Descriptor.apply(self, orders, desc.axis_neuron, float(desc.nnei), s)

    def tbar_of(self, desc, t: Tensor, grad: Tensor) -> Tensor:
        """dE/dT (B, A, M) as ``explicit_descriptor._tbar_of`` (torch's operations where the
        products were not measured to match)."""
        orders = self.orders(t.dtype, t.shape[1], t.shape[2], desc.axis_neuron)
        dd = grad.reshape(-1, t.shape[2], desc.axis_neuron)
        if orders is None:
            return torch_tbar_of(t, dd, desc.nnei)
        return _Tbar.apply(self, orders, float(desc.nnei), t, dd)


def _threads() -> int:
    return torch.get_num_threads()


class _Descriptor(torch.autograd.Function):
    """D = TᵀT< (B, M·X) and t = s/nnei (B, A, M) from the contraction's sum s: t is an output,
    so that dE/dT's gradient of it comes back to this node, which forms s's gradient as
    autograd did when t was a division of its own and D took t twice: (t̄ + [t dD̄, 0] +
    (dD̄ t<ᵀ)ᵀ)/nnei, added in that order (t̄ arrives first: dE/dD, D's cotangent, comes from
    dE/dT's backward), in one pass instead of a division, two additions and their nodes."""

    @staticmethod
    def forward(ctx, prod: DescriptorProducts, orders, x: int, nnei: float, s: Tensor):
        s = s.contiguous()
        batch, rows, m = s.shape
        t, d = torch.empty_like(s), s.new_empty(batch, m * x)
        status = prod.fn("descriptor_forward", s.dtype)(
            batch, rows, m, x, _ptr(s), nnei, _ptr(t), _ptr(d), _at(orders, 0), _threads()
        )
        _check(status, "descriptor")
        ctx.prod, ctx.orders, ctx.x, ctx.nnei = prod, orders, x, nnei
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(t)
        return d, t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_bar: Tensor | None, t_bar: Tensor | None):
        (t,) = ctx.saved_tensors
        if d_bar is None:
            return None, None, None, None, None if t_bar is None else t_bar / ctx.nnei
        batch, rows, m = t.shape
        d_bar = d_bar.contiguous()
        t_bar = None if t_bar is None else t_bar.contiguous()
        s_bar = torch.empty_like(t)
        status = ctx.prod.fn("descriptor_backward", t.dtype)(
            batch, rows, m, ctx.x, _ptr(t), _ptr(d_bar), None if t_bar is None else _ptr(t_bar),
            ctx.nnei, _ptr(s_bar), _at(ctx.orders, 1), _threads(),
        )  # fmt: skip
        _check(status, "descriptor backward")
        return None, None, None, None, s_bar


class _Tbar(torch.autograd.Function):
    """dE/dT (B, A, M) from T/nnei t and dE/dD dd (B, M, X)."""

    @staticmethod
    def forward(ctx, prod: DescriptorProducts, orders, nnei: float, t: Tensor, dd: Tensor):
        t, dd = t.contiguous(), dd.contiguous()
        batch, rows, m = t.shape
        out = torch.empty_like(t)
        status = prod.fn("tbar_forward", t.dtype)(
            batch, rows, m, dd.shape[2], _ptr(t), _ptr(dd), nnei, _ptr(out),
            _at(orders, 3), _threads(),
        )  # fmt: skip
        _check(status, "dE/dT")
        ctx.prod, ctx.orders, ctx.nnei = prod, orders, nnei
        ctx.save_for_backward(t, dd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        t, dd = ctx.saved_tensors
        batch, rows, m = t.shape
        g = g.contiguous()
        t_bar, dd_bar = torch.empty_like(t), torch.empty_like(dd)
        status = ctx.prod.fn("tbar_backward", t.dtype)(
            batch, rows, m, dd.shape[2], _ptr(t), _ptr(dd), _ptr(g), ctx.nnei, _ptr(t_bar),
            _ptr(dd_bar), _at(ctx.orders, 5), _threads(),
        )  # fmt: skip
        _check(status, "dE/dT backward")
        return None, None, None, t_bar, dd_bar


def torch_descriptor_of_t(t: Tensor, x: int) -> Tensor:
    """se_e2_a's D of T/nnei in torch's operations (``DescriptorSeA.descriptor_of_t``)."""
    d = torch.matmul(t.transpose(1, 2), t[:, :, :x])
    return d.reshape(t.shape[0], -1)


def torch_tbar_of(t: Tensor, dd: Tensor, nnei: int) -> Tensor:
    """dE/dT in torch's operations (``explicit_descriptor._tbar_of``)."""
    x = dd.shape[2]
    tbar = torch.bmm(t[:, :, :x], dd.transpose(1, 2))
    tbar = torch.cat([tbar[:, :, :x] + torch.bmm(t, dd), tbar[:, :, x:]], dim=2)
    return tbar / nnei


def _nodes_match(
    prod: DescriptorProducts, orders, t, dd, d_bar, g, x: int, nnei: int = 138
) -> bool:
    """Both nodes against torch's operations: values and the gradients of t and dd, with the
    nodes used as the model uses them (dE/dT's backward runs before D's)."""
    results = []
    for compiled in (False, True):
        tmat = (t * nnei).requires_grad_()
        ddl = dd.clone().requires_grad_()
        if compiled:
            d, tt = _Descriptor.apply(prod, orders, x, float(nnei), tmat)
            tbar = _Tbar.apply(prod, orders, float(nnei), tt, ddl)
        else:
            tt = tmat / nnei
            d = torch_descriptor_of_t(tt, x)
            tbar = torch_tbar_of(tt, ddl, nnei)
        # a scalar loss (as in training): autograd.grad with explicit cotangents imports
        # seconds of modules on its first call; 1·x keeps every bit of the cotangents
        ((d * d_bar.reshape(d.shape)).sum() + (tbar * g).sum()).backward()
        results.append([d.detach(), tbar.detach(), tmat.grad, ddl.grad])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))
