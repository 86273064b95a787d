"""Compiled embedding-net kernels (``csrc/embedding.cpp``), built on first use.

The training step spends most of its time in the embedding net, on products too narrow for the
BLAS library to split well over threads, and on elementwise passes between them. The compiled
kernels hand whole blocks of centres to each of torch's OpenMP threads, which run every layer of
their block with single-threaded BLAS products and fused loops. They are built with the system's
C++ compiler (``$CXX``, else ``c++``) for this machine (``-march=native``), against the OpenMP
runtime and BLAS already loaded by torch, and cached under ``$MDTRAIN_CACHE_DIR`` (default
``~/.cache/mdtrain``) by a hash of the source, the compiler, torch and the CPU. When that is not
possible (no compiler, a torch without the BLAS symbols), or with ``MDTRAIN_NATIVE=0``, the PyTorch
path (``mdtrain.model.fused_embedding``) runs instead, with one log line saying why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "embedding.cpp"
ABI_VERSION = 4
BLAS_CHOICES = ("auto", "torch", "openblas")
BLOCK_ROWS = 512  # 256–1024 alike on the water step; 4096 was 12 % slower
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _cpu_signature() -> str:
    """The CPU model and feature flags: a build for one CPU must not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("MDTRAIN_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mdtrain"


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).parent / "lib"


def _openmp_link_args() -> list[str]:
    """Link against the OpenMP runtime torch uses, so that both share one thread pool."""
    bundled = sorted(_torch_lib_dir().glob("libgomp*.so*"))
    if bundled:
        return [str(bundled[0]), f"-Wl,-rpath,{bundled[0].parent}"]
    return []


def _build(compiler: str) -> Path:
    """Compile the kernels (or find them in the cache); raises ``RuntimeError`` with the reason."""
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"no C++ compiler ({compiler}): {exc}") from None
    link = _openmp_link_args()
    key = hashlib.sha256(
        "\0".join(
            [
                SOURCE.read_text(),
                version,
                " ".join(flags + link),
                torch.__version__,
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    name = f"embedding-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"mdtrain-{os.getuid()}"):
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            break
    else:
        raise RuntimeError(f"no writable folder for the build ({_cache_dir()})")
    # Several ranks may build at once: each writes its own file and renames it into place.
    log.info("building the compiled embedding kernels (once per machine type): %s", target)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp, *link],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"compiling {SOURCE.name} failed: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Kernels:
    """The loaded library, with argument types declared once."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if lib.mdt_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} is from another version of mdtrain")
        lib.mdt_set_blas.argtypes = [_P, _P, _INT, _P, _P, _P]
        self.lib = lib
        self.blas = ""  # the BLAS the products run on: "openblas" or "torch"
        self.use_blas(os.environ.get("MDTRAIN_BLAS", "auto"))
        net = [_INT, *[_P] * 10]  # layers, n_in, n_out, skip, W, b, idt, ts, outs, douts, das
        rows = [_P, _I64, _I64, _I64]
        plan = [_P, _P, _P, _P, _I64]
        for suffix in ("f32", "f64"):
            fn = getattr(lib, f"mdt_embed_forward_{suffix}")
            fn.argtypes = [*rows, *net, *plan, _P, _INT]
            fn = getattr(lib, f"mdt_embed_backward_{suffix}")
            fn.argtypes = [*rows, *net, *plan, _I64, *[_P] * 6, _INT]
            for name in ("mdt_row_grad_", "mdt_row_grad_tbar_"):
                fn = getattr(lib, name + suffix)
                fn.argtypes = [*rows, *plan, _I64, _INT, *[_P] * 4, _INT]

    def use_blas(self, choice: str) -> str:
        """Point the kernels' products at a BLAS: "torch" (the one inside torch, usually MKL),
        "openblas" (numpy's OpenBLAS, 4 % faster steps on an AMD EPYC, where MKL takes a
        generic path) or "auto" (OpenBLAS when usable). Returns the one chosen."""
        if choice not in BLAS_CHOICES:
            raise RuntimeError(f"MDTRAIN_BLAS={choice!r} is not one of {BLAS_CHOICES}")
        entry = _numpy_openblas() if choice in ("auto", "openblas") else None
        if choice == "openblas" and entry is None:
            raise RuntimeError("MDTRAIN_BLAS=openblas, but numpy's OpenBLAS is not usable here")
        chosen = "openblas" if entry is not None else "torch"
        if entry is None:
            entry = _torch_blas()
        dgemm, sgemm, ilp64, *threads = entry
        self.lib.mdt_set_blas(_address(dgemm), _address(sgemm), ilp64, *map(_address, threads))
        self.blas = chosen
        return chosen

    def supports(self, *tensors: Tensor) -> bool:
        first = tensors[0]
        return (
            first.device.type == "cpu"
            and first.dtype in (torch.float32, torch.float64)
            and all(t.dtype == first.dtype for t in tensors)
        )

    def _fn(self, name: str, dtype: torch.dtype):
        return getattr(self.lib, f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")

    def embed_forward(self, rows: Tensor, layout, params, tape, plan, tmat: Tensor) -> None:
        """Fill the tape (G, dG/ds and what the backward needs) and T (B, 4, M) over the
        slots the plan evaluates."""
        fn = self._fn("mdt_embed_forward", rows.dtype)
        threads = torch.get_num_threads()
        fn(
            *_rows_args(rows),
            *net_args(layout, params, tape),
            *_plan_args(plan),
            _pointer(tmat),
            threads,
        )

    def embed_backward(self, rows: Tensor, layout, params, tape, plan, cotangents, grads) -> None:
        """Accumulate the parameter gradients into ``grads`` (zeros, parameter order) from the
        cotangents ``(T̄_T, Ḡ, dḠ, Z, T̄)`` of T, G, dG/ds and the row gradients (any None)."""
        fn = self._fn("mdt_embed_backward", rows.dtype)
        by_layer = []
        k = 0
        for _, _, has_idt in layout:
            by_layer += [grads[k], grads[k + 1], grads[k + 2] if has_idt else None]
            k += 3 if has_idt else 2
        fn(
            *_rows_args(rows),
            *net_args(layout, params, tape),
            *_plan_args(plan),
            rows.shape[2],
            *(_pointer(c) for c in cotangents),
            _pointers(by_layer),
            torch.get_num_threads(),
        )

    def row_grad(self, tbar: Tensor, value: Tensor, slope: Tensor, rows: Tensor, plan) -> Tensor:
        """dE/dR̃ (B, n, 4) of one block of slot columns, rows (B, 4, n); 0 on the slots the
        plan does not evaluate."""
        nc, n, m = rows.shape[0], rows.shape[2], value.shape[-1]
        out = value.new_empty(nc, n, 4)
        fn = self._fn("mdt_row_grad", value.dtype)
        fn(
            *_rows_args(rows),
            *_plan_args(plan),
            n,
            m,
            *map(_pointer, (tbar, value, slope)),
            _pointer(out),
            torch.get_num_threads(),
        )
        return out

    def row_grad_tbar(self, z: Tensor, value: Tensor, slope: Tensor, rows: Tensor, plan) -> Tensor:
        """The T̄ (B, 4, M) part of ``row_grad``'s backward for the cotangent z (B, n, 4)."""
        nc, n, m = rows.shape[0], rows.shape[2], value.shape[-1]
        out = value.new_empty(nc, 4, m)
        fn = self._fn("mdt_row_grad_tbar", value.dtype)
        fn(
            *_rows_args(rows),
            *_plan_args(plan),
            n,
            m,
            *map(_pointer, (z, value, slope)),
            _pointer(out),
            torch.get_num_threads(),
        )
        return out


class BlockPlan(NamedTuple):
    """How the kernels cut one embedding call into blocks of centres (int64 tensors).

    Block b holds the centres ``order[start[b] : start[b + 1]]`` and evaluates the first
    ``width[b]`` slots of each, as tape rows from ``row0[b]``; ``widths`` (B,) is each centre's
    evaluated width in the original order; ``row0[-1]`` is the number of tape rows.
    """

    order: Tensor
    start: Tensor
    width: Tensor
    row0: Tensor
    widths: Tensor

    @property
    def rows(self) -> int:
        return int(self.row0[-1])


def plan_blocks(used: Tensor | None, nc: int, n: int) -> BlockPlan:
    """Blocks of about ``BLOCK_ROWS`` rows over ``nc`` centres with ``n`` slot columns.

    ``used`` (B,): the slots each centre needs (one past its last real neighbour). Centres are
    then sorted by it, so that a block's width, its largest ``used``, wastes few rows on padding
    (about 10 % fewer rows than the rectangle on water). None: every centre evaluates all n.
    """
    per = centres_per_block(nc, n)
    start = torch.cat([torch.arange(0, nc, per), torch.tensor([nc])])
    if used is None:
        order = torch.arange(nc)
        width = torch.full((len(start) - 1,), n, dtype=torch.int64)
    else:
        used = used.to(device="cpu", dtype=torch.int64)
        order = torch.sort(used, descending=True, stable=True).indices
        width = used[order][start[:-1]]
    sizes = start[1:] - start[:-1]
    row0 = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes * width, 0)])
    widths = torch.empty(nc, dtype=torch.int64)
    widths[order] = torch.repeat_interleave(width, sizes)
    return BlockPlan(order, start, width, row0, widths)


def _plan_args(plan: BlockPlan) -> list:
    return [
        _pointer(plan.order),
        _pointer(plan.start),
        _pointer(plan.width),
        _pointer(plan.row0),
        len(plan.width),
    ]


def _address(fn) -> _P:
    return _P(ctypes.cast(fn, _P).value if fn is not None else None)


def _torch_blas() -> tuple:
    """torch's own BLAS (32-bit integers), with MKL's per-thread thread count when present."""
    torch_cpu = ctypes.CDLL(str(_torch_lib_dir() / "libtorch_cpu.so"))
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
    return (_P * len(tensors))(*[_pointer(t) for t in tensors])


def _ints(values) -> ctypes.Array:
    return (_INT * len(values))(*values)


def _rows_args(rows: Tensor) -> list:
    """Rows (B, 4, n) of any strides: pointer and the strides of centre, component, slot."""
    rc, ra, rj = rows.stride()
    return [_pointer(rows), rc, ra, rj]


def net_args(layout: tuple, params, tape) -> list:
    """The net's layout, parameters and tape buffers (``fused_embedding._Tape``) as C arrays."""
    weights, biases, idts = [], [], []
    k = 0
    for _, _, has_idt in layout:
        weights.append(params[k])
        biases.append(params[k + 1])
        idts.append(params[k + 2] if has_idt else None)
        k += 3 if has_idt else 2
    return [
        len(layout),
        _ints([n_in for n_in, _, _ in layout]),
        _ints([int(w.shape[1]) for w in weights]),
        _ints([skip for _, skip, _ in layout]),
        _pointers(weights),
        _pointers(biases),
        _pointers(idts),
        _pointers(tape.ts),
        _pointers(tape.outs),
        _pointers(tape.douts),
        _pointers(tape.das),
    ]


def centres_per_block(nc: int, n: int) -> int:
    """Centres per block: about ``BLOCK_ROWS`` rows, and a whole number of blocks per thread
    (the threads take blocks in turn)."""
    threads = torch.get_num_threads()
    rounds = max(1, round(nc * max(n, 1) / (BLOCK_ROWS * threads)))
    return max(1, -(-nc // (rounds * threads)))


@lru_cache(maxsize=1)
def kernels() -> Kernels | None:
    """The compiled kernels, or None (reason logged once) when they cannot be used here."""
    if os.environ.get("MDTRAIN_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if platform.system() != "Linux" or not (_torch_lib_dir() / "libtorch_cpu.so").exists():
        log.info("compiled embedding kernels: not supported on this platform; using PyTorch ops")
        return None
    try:
        loaded = Kernels(_build(os.environ.get("CXX", "c++")))
        log.info("compiled embedding kernels in use (products on %s)", loaded.blas)
        return loaded
    except (RuntimeError, OSError) as exc:
        log.warning("compiled embedding kernels unavailable (%s); using PyTorch ops", exc)
        return None
