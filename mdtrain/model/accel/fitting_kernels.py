"""The fitting node's compiled elementwise loops (``csrc/fitting.cpp``, in the library
``build.py`` builds) with their ctypes argument types, declared once per loaded library.

Each loop is one pass over a layer's (K, n, m) arrays, K nets stacked (1 for one net): the work
that the plain node (``fitting_node``) does as several small torch operations per layer. The
arrays are contiguous except the sweep's input gradient ``g`` and ``idt``, passed with strides.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from mdtrain.model.accel.kernels import Kernels

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _ptr(t: Tensor | None) -> int | None:
    """A tensor's address (ctypes converts an int or None for a ``c_void_p`` argument)."""
    return None if t is None else t.data_ptr()


def _dims(t: Tensor) -> tuple[int, int, int]:
    """(K, n, m) of a layer array (n, m) or (K, n, m)."""
    return (1, *t.shape) if t.dim() == 2 else tuple(t.shape)


def _idt(idt: Tensor | None) -> tuple[int | None, int]:
    """idt (m,) or (K, 1, m): pointer and stride between nets."""
    if idt is None:
        return None, 0
    return _ptr(idt), (idt.stride(0) if idt.dim() == 3 else 0)


def _strided(g: Tensor) -> tuple[int | None, int, int]:
    """The sweep's g (n, m) or (K, n, m), rows possibly broadcast: pointer, net and row
    strides."""
    if g.dim() == 2:
        return _ptr(g), 0, g.stride(0)
    return _ptr(g), g.stride(0), g.stride(1)


class FittingKernels:
    """The loops of one loaded library, float32 and float64."""

    def __init__(self, kernels: Kernels) -> None:
        lib = kernels.lib
        self._fns: dict[tuple[str, bool], object] = {}
        for suffix, wide in (("f32", False), ("f64", True)):
            table = {
                "combine": [_I64, _I64, _I64, _INT, _P, _P, _I64, _P, _P],
                "slope": [_I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _P, _INT],
                "sweep_back": [
                    _I64,
                    _I64,
                    _I64,
                    _INT,
                    _P,
                    _P,
                    _P,
                    _I64,
                    _I64,
                    _P,
                    _I64,
                    *[_P] * 4,
                    _INT,
                ],
                "forward_back": [_I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _INT],
            }
            for name, argtypes in table.items():
                fn = getattr(lib, f"mdt_fit_{name}_{suffix}")
                fn.argtypes = argtypes
                fn.restype = None
                self._fns[name, wide] = fn
        self.fused: dict[bool, int] = {}
        for wide in (False, True):
            self.fused[wide] = self._probe(torch.float64 if wide else torch.float32)

    def _probe(self, dtype: torch.dtype) -> int:
        """How torch's ``tanh_backward`` rounds ``1 − t²`` in this process: 1 once (an FMA,
        as its AVX2 kernels compile it), 0 twice, -1 neither (the loops are not used then).
        The loops round it the same way, so that they equal the plain node bit for bit."""
        gen = torch.Generator().manual_seed(0)
        # enough elements for torch's vector path and a scalar tail
        t = torch.rand(1, 4099, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.rand(1, 4099, generator=gen, dtype=torch.float64).to(dtype) + 1
        want = torch.ops.aten.tanh_backward(g, t)
        for fused in (1, 0):
            self.fused[dtype == torch.float64] = fused
            if torch.equal(self.slope(g, None, t), want):
                return fused
        return -1

    @property
    def usable(self) -> bool:
        """Whether the loops reproduce torch's rounding in both precisions."""
        return min(self.fused.values()) >= 0

    def _fn(self, name: str, t: Tensor):
        return self._fns[name, t.element_size() == 8]

    def _fused(self, t: Tensor) -> int:
        return int(self.fused[t.element_size() == 8])

    def combine(self, t: Tensor, idt: Tensor | None, x: Tensor | None, skip: int) -> Tensor:
        """y = t·idt + skip(x) (x contiguous; None without a skip)."""
        y = t.new_empty(t.shape)
        self._fn("combine", t)(*_dims(t), skip, _ptr(t), *_idt(idt), _ptr(x), _ptr(y))
        return y

    def slope(self, g: Tensor, idt: Tensor | None, t: Tensor) -> Tensor:
        """p = (g·idt)(1 − t²)."""
        p = t.new_empty(t.shape)
        self._fn("slope", t)(*_dims(t), *_strided(g), *_idt(idt), _ptr(t), _ptr(p), self._fused(t))
        return p

    def sweep_back(
        self, pbar: Tensor, t: Tensor, g: Tensor, idt: Tensor | None, gbar: Tensor, skip: int
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """The reverse of one sweep layer from p̄: (r·g or None without idt, t's extra
        cotangent, the next ḡ); ``gbar`` contiguous."""
        ru = t.new_empty(t.shape) if idt is not None else None
        t_extra, gnext = t.new_empty(t.shape), t.new_empty(t.shape)
        self._fn("sweep_back", t)(
            *_dims(t), skip, _ptr(pbar), _ptr(t), *_strided(g), *_idt(idt),
            _ptr(gbar if skip else None), _ptr(ru), _ptr(t_extra), _ptr(gnext), self._fused(t),
        )  # fmt: skip
        return ru, t_extra, gnext

    def forward_back(
        self, ybar: Tensor, t: Tensor, idt: Tensor | None, t_extra: Tensor | None
    ) -> tuple[Tensor | None, Tensor]:
        """The reverse of one forward layer from ȳ: (ȳ·t or None without idt, ā)."""
        yt = t.new_empty(t.shape) if idt is not None else None
        abar = t.new_empty(t.shape)
        self._fn("forward_back", t)(
            *_dims(t),
            _ptr(ybar),
            _ptr(t),
            *_idt(idt),
            _ptr(t_extra),
            _ptr(yt),
            _ptr(abar),
            self._fused(t),
        )
        return yt, abar

    def __deepcopy__(self, memo):  # holds the loaded library: copies of a model share it
        return self
