"""The compiled embedding kernels as a Python object: the library built by ``build.py``,
loaded through ctypes (no torch headers), with argument types declared once and the BLAS its
products run on chosen when it loads (``MDTRAIN_BLAS``).

The training step spends most of its time in the embedding net, on products too narrow for the
BLAS library to split well over threads, and on elementwise passes between them. The kernels
hand whole blocks of centres to each of torch's OpenMP threads, which run every layer of their
block with single-threaded BLAS products and fused loops. They see tensors as pointers and
strides: keep the layouts in the C++ header comment and here in step, and raise
``ABI_VERSION`` (and ``mdt_abi_version``) when a signature changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch
from torch import Tensor

from mdtrain.model.accel.build import build, torch_lib_dir

ABI_VERSION = 9
BLAS_CHOICES = ("auto", "torch", "openblas")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


class Kernels:
    """The loaded library, with argument types declared once."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.mdt_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} is from another version of mdtrain")
        lib.mdt_set_blas.argtypes = [_P, _P, _INT, _P, _P, _P]
        lib.mdt_reserve_blas.argtypes = [_INT]
        self.lib = lib
        self.blas = ""  # the BLAS the products run on: "openblas" or "torch"
        self.reserved = 0  # threads whose BLAS buffers exist (see ``_threads``)
        self.use_blas(os.environ.get("MDTRAIN_BLAS", "auto"))
        net = [_INT, *[_P] * 10]  # layers, n_in, n_out, skip, W, b, idt, ts, outs, douts, das
        rows = [_P, _I64, _I64, _I64, _INT]  # pointer, strides, components A
        plan = [_P, _P, _P, _P, _I64]
        for suffix in ("f32", "f64"):
            fn = getattr(lib, f"mdt_embed_forward_{suffix}")
            fn.argtypes = [*rows, *net, *plan, _P, _INT]
            fn = getattr(lib, f"mdt_embed_backward_{suffix}")
            fn.argtypes = [*rows, *net, *plan, _I64, *[_P] * 6, _INT]
            fn = getattr(lib, f"mdt_rows_grad_{suffix}")  # csrc/row_grad.cpp
            fn.argtypes = [*rows, *plan, _INT, *[_P] * 4, _I64, _INT, _I64, _INT]
            fn = getattr(lib, f"mdt_rows_grad_tbar_{suffix}")
            fn.argtypes = [*rows, *plan, _INT, _P, _I64, _INT, *[_P] * 3, _INT, _INT]
            fn = getattr(lib, f"mdt_padded_share_{suffix}")
            fn.argtypes = [_P, _P, _I64, _I64, _INT, _INT, _P, _P, _I64, _P]
            fn = getattr(lib, f"mdt_padded_share_backward_{suffix}")
            fn.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT, _INT, _P]

    def use_blas(self, choice: str) -> str:
        """Point the kernels' products at a BLAS: "torch" (the one inside torch, usually MKL;
        also "auto") or "openblas" (numpy's OpenBLAS: 3–4 % faster steps on an AMD EPYC, where
        MKL takes a generic path, but an OpenBLAS that cannot allocate a working buffer ends
        the process, which an address-space-limited training run showed in about 1 of 10
        runs even with the buffers reserved: opt in only where memory cannot run out).
        Returns the one chosen."""
        if choice not in BLAS_CHOICES:
            raise RuntimeError(f"MDTRAIN_BLAS={choice!r} is not one of {BLAS_CHOICES}")
        entry = _numpy_openblas() if choice == "openblas" else None
        if choice == "openblas" and entry is None:
            raise RuntimeError("MDTRAIN_BLAS=openblas, but numpy's OpenBLAS is not usable here")
        chosen = "openblas" if entry is not None else "torch"
        if entry is None:
            entry = _torch_blas()
        dgemm, sgemm, ilp64, *threads = entry
        self.lib.mdt_set_blas(_address(dgemm), _address(sgemm), ilp64, *map(_address, threads))
        self.blas = chosen
        self.reserved = 0
        self._threads()
        return chosen

    def _threads(self) -> int:
        """torch's thread count, the kernels' team size; the first time a team this large
        runs, its threads take their BLAS buffers together, before any real work (an
        OpenBLAS that fails to allocate one later would end the process)."""
        threads = torch.get_num_threads()
        if threads > self.reserved:
            _check(self.lib.mdt_reserve_blas(threads), "reserving BLAS buffers")
            self.reserved = threads
        return threads

    def _fn(self, name: str, dtype: torch.dtype):
        return getattr(self.lib, f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")

    def embed_forward(self, rows: Tensor, layout, params, tape, plan, tmat: Tensor) -> None:
        """Fill the tape (G, dG/ds and what the backward needs) and T (B, A, M) over the
        slots the plan evaluates."""
        fn = self._fn("mdt_embed_forward", rows.dtype)
        status = fn(
            *_rows_args(rows),
            *net_args(layout, params, tape),
            *_plan_args(plan),
            _pointer(tmat),
            self._threads(),
        )
        _check(status, "embedding forward")

    def embed_backward(self, rows: Tensor, layout, params, tape, plan, cotangents, grads) -> None:
        """Accumulate the parameter gradients into ``grads`` (zeros, parameter order) from the
        cotangents ``(T̄_T, Ḡ, dḠ, Z, T̄)`` of T, G, dG/ds and the row gradients (any None)."""
        fn = self._fn("mdt_embed_backward", rows.dtype)
        by_layer = []
        k = 0
        for _, _, has_idt in layout:
            by_layer += [grads[k], grads[k + 1], grads[k + 2] if has_idt else None]
            k += 3 if has_idt else 2
        status = fn(
            *_rows_args(rows),
            *net_args(layout, params, tape),
            *_plan_args(plan),
            rows.shape[2],
            *(_pointer(c) for c in cotangents),
            _pointers(by_layer),
            self._threads(),
        )
        _check(status, "embedding backward")

    def row_grad_into(self, tbar, value, slope, rows: Tensor, plan, out: Tensor) -> None:
        """Write dE/dR̃ of one block of slot columns, rows (B, A, n), from T̄ (B, A, M) and the
        block's G and dG/ds (tape rows, M) into ``out`` (B, f, W): f ≥ n slots (0 past each
        centre's evaluated ones), the first W ≤ A components, any stride between centres (a
        slice of a wider tensor)."""
        fn = self._fn("mdt_rows_grad", value.dtype)
        status = fn(
            *_rows_args(rows),
            *_plan_args(plan),
            value.shape[-1],
            *map(_pointer, (tbar, value, slope, out)),
            *_slice_args(out),
            out.shape[1],
            self._threads(),
        )
        _check(status, "row gradients")

    def row_grad_tbar(
        self, z: Tensor, value: Tensor, slope: Tensor, rows: Tensor, plan, add: Tensor | None = None
    ) -> Tensor:
        """The T̄ (B, A, M) part of ``row_grad_into``'s backward for the cotangent z (B, ≥n,
        W ≤ A; its output's layout, components past W taken as 0); ``add`` (or None): a T̄ of
        the same shape that the part is added to in place (``add + part``), and returned."""
        out = value.new_empty(rows.shape[0], rows.shape[1], value.shape[-1]) if add is None else add
        fn = self._fn("mdt_rows_grad_tbar", value.dtype)
        status = fn(
            *_rows_args(rows),
            *_plan_args(plan),
            value.shape[-1],
            _pointer(z),
            *_slice_args(z),
            *map(_pointer, (value, slope, out)),
            add is not None,
            self._threads(),
        )
        _check(status, "row-gradient backward")
        return out

    def padded_share(self, rows: Tensor, g: Tensor, first: Tensor, kind: Tensor) -> Tensor:
        """``kernel_nodes.padded_share`` (B, A, M) from contiguous padded rows (types, cols, A),
        their G (types·cols, M) and each centre's first padded column and type (int64, B)."""
        out = g.new_empty(first.shape[0], rows.shape[2], g.shape[1])
        fn = self._fn("mdt_padded_share", g.dtype)
        status = fn(
            _pointer(rows), _pointer(g), *rows.shape, g.shape[1],
            _pointer(first), _pointer(kind), first.shape[0], _pointer(out),
        )  # fmt: skip
        _check(status, "padded share")
        return out

    def padded_share_terms(self, grad: Tensor, first: Tensor, kind: Tensor, rows: Tensor) -> Tensor:
        """The cotangent (types, cols, A, M) of ``padded_share``'s products R̃ᵀG per padded row
        from the cotangent ``grad`` (B, A, M) of its output."""
        terms = grad.new_empty(*rows.shape, grad.shape[2])
        fn = self._fn("mdt_padded_share_backward", grad.dtype)
        status = fn(
            _pointer(grad), _pointer(first), _pointer(kind), first.shape[0],
            *rows.shape, grad.shape[2], _pointer(terms),
        )  # fmt: skip
        _check(status, "padded share backward")
        return terms


OUT_OF_MEMORY = 1  # the kernels' status for std::bad_alloc (kOutOfMemory in the C++ source)


def _check(status: int, what: str) -> None:
    """Raise the kernels' status as an exception: ``MemoryError`` (an out-of-memory error the
    batch controller and the inference chunker recover from) for an allocation failure."""
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"compiled embedding kernels, {what}: std::bad_alloc (out of memory)")
    if status != 0:
        raise RuntimeError(f"compiled embedding kernels, {what}: status {status}")


def _plan_args(plan) -> list:
    """A ``kernel_nodes.BlockPlan`` as the kernels' arguments."""
    return [
        _pointer(plan.order),
        _pointer(plan.start),
        _pointer(plan.width),
        _pointer(plan.row0),
        len(plan.width),
    ]


def _slice_args(t: Tensor) -> list:
    """A (B, f, W) slice with unit strides inside a row: its stride between centres and W."""
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
        raise RuntimeError("row gradients need rows of (slots, W) without gaps")
    return [t.stride(0), t.shape[2]]


def _address(fn) -> _P:
    return _P(ctypes.cast(fn, _P).value if fn is not None else None)


def _torch_blas() -> tuple:
    """torch's own BLAS (32-bit integers), with MKL's per-thread thread count when present."""
    torch_cpu = ctypes.CDLL(str(torch_lib_dir() / "libtorch_cpu.so"))
    try:
        dgemm, sgemm = torch_cpu.dgemm_, torch_cpu.sgemm_
    except AttributeError:
        raise RuntimeError("this torch build exports no BLAS (dgemm_/sgemm_)") from None
    return dgemm, sgemm, 0, getattr(torch_cpu, "MKL_Set_Num_Threads_Local", None), None, None


def _numpy_openblas() -> tuple | None:
    """The OpenBLAS inside numpy's wheel (64-bit integers). Built with pthreads, it has only a
    process-wide thread count: the kernels set it to 1 for their calls and restore it."""
    import numpy

    folder = Path(numpy.__file__).parent.parent / "numpy.libs"
    for path in sorted(folder.glob("libscipy_openblas64_*.so")):
        try:
            lib = ctypes.CDLL(str(path))
            threads = (lib.scipy_openblas_set_num_threads64_, lib.scipy_openblas_get_num_threads64_)
            return lib.scipy_dgemm_64_, lib.scipy_sgemm_64_, 1, None, *threads
        except (OSError, AttributeError):
            continue
    return None


def _pointer(t: Tensor | None) -> _P:
    return _P(t.data_ptr() if t is not None else None)


def _pointers(tensors) -> ctypes.Array:
    return (_P * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def _ints(values) -> ctypes.Array:
    return (_INT * len(values))(*values)


def _rows_args(rows: Tensor) -> list:
    """Rows (B, A, n) of any strides: pointer, the strides of centre, component, slot, and A
    (4 for se_e2_a, 2 for se_e2_r: the widths the kernels are compiled for)."""
    rc, ra, rj = rows.stride()
    return [_pointer(rows), rc, ra, rj, rows.shape[1]]


@functools.lru_cache(maxsize=256)
def _shape_args(layout: tuple, n_out: tuple) -> tuple:
    """The net's layers, widths and skips as C arrays, made once per net shape (the kernels
    only read them; building them was a good part of a call's fixed cost)."""
    return (
        len(layout),
        _ints([n_in for n_in, _, _ in layout]),
        _ints(n_out),
        _ints([skip for _, skip, _ in layout]),
    )


def net_args(layout: tuple, params, tape) -> list:
    """The net's layout, parameters and tape buffers (``embedding_nodes.Tape``) as C arrays."""
    weights, biases, idts = [], [], []
    k = 0
    for _, _, has_idt in layout:
        weights.append(params[k])
        biases.append(params[k + 1])
        idts.append(params[k + 2] if has_idt else None)
        k += 3 if has_idt else 2
    return [
        *_shape_args(layout, tuple(w.shape[1] for w in weights)),
        _pointers(weights),
        _pointers(biases),
        _pointers(idts),
        _pointers(tape.ts),
        _pointers(tape.outs),
        _pointers(tape.douts),
        _pointers(tape.das),
    ]


_loaded: Kernels | RuntimeError | None = None


def load_kernels() -> Kernels:
    """The compiled kernels, built or taken from the cache once per process; raises
    ``RuntimeError`` saying why they cannot be used here (the same error on every call)."""
    global _loaded
    if _loaded is None:
        try:
            if platform.system() != "Linux" or not (torch_lib_dir() / "libtorch_cpu.so").exists():
                raise RuntimeError("not supported on this platform")
            _loaded = Kernels(build(os.environ.get("CXX", "c++")))
        except (RuntimeError, OSError) as exc:
            _loaded = RuntimeError(str(exc))
    if isinstance(_loaded, RuntimeError):
        raise _loaded
    return _loaded
