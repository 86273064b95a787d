"""The compiled embedding kernels (``mdtrain.model.accel.kernel_nodes``) against the PyTorch
nodes of the same maths (``mdtrain.model.accel.embedding_nodes``), their build, and the
selection's answer when they cannot be built.

The model-level comparison with the reference model is in ``test_backends.py``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil

import pytest
import torch

from mdtrain.errors import MDTrainError
from mdtrain.model.accel import build, kernel_nodes, kernels
from mdtrain.model.accel.embedding_nodes import (
    EmbeddedBlock,
    TorchEmbedding,
    _EmbedContract,
    _RowGrad,
)
from mdtrain.model.accel.kernel_nodes import _KernelEmbedContract, _KernelRowGrads, plan_blocks
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.backend import build_model
from mdtrain.model.network import EmbeddingNet
from tests.helpers.models import small_config

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_kernels = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler")


@needs_kernels
def test_kernels_build_where_a_compiler_exists():
    assert isinstance(kernels.load_kernels(), kernels.Kernels)
    assert build_model(small_config()).backend == "kernels"


@pytest.fixture(params=["torch", "openblas"])
def blas(request):
    """The kernels' products on torch's BLAS, then on numpy's OpenBLAS (where usable)."""
    loaded = kernels.load_kernels()
    if request.param == "openblas" and kernels._numpy_openblas() is None:
        pytest.skip("numpy's OpenBLAS is not usable here")
    before = loaded.blas
    loaded.use_blas(request.param)
    yield request.param
    loaded.use_blas(before)


def _node_outputs(net, rows, cot, use_kernels, used=None):
    """T, G, dG/ds (as (B, n, M)), the row gradients, and the parameter gradients of a loss on
    T and on the row gradients, through the two autograd nodes of the kernels or of PyTorch."""
    layout, params = layer_layout(net.layers), layer_params(net.layers)
    if use_kernels:
        lib, plan = kernels.load_kernels(), plan_blocks(used, rows.shape[0], rows.shape[2])
        tmat, value, slope = _KernelEmbedContract.apply(rows, lib, plan, layout, *params)
        tbar = torch.tanh(tmat)  # a T̄ that depends on the parameters, as in the model
        span = ((0, rows.shape[2], plan),)  # one block of all columns of rows (B, n, A)
        rbar = _KernelRowGrads.apply(
            tbar, rows.transpose(1, 2), lib, span, rows.shape[1], value, slope
        )
    else:
        tmat, value, slope = _EmbedContract.apply(rows, layout, *params)
        rbar = _RowGrad.apply(torch.tanh(tmat), value, slope, rows)
    loss = (cot[0] * tmat).sum() + (cot[1] * rbar).sum()
    grads = torch.autograd.grad(loss, params)
    if use_kernels and used is None:  # centres kept in order: (tape rows, M) is (B, n, M)
        value, slope = (t.view(rows.shape[0], rows.shape[2], -1) for t in (value, slope))
    if use_kernels and used is not None:
        return [tmat.detach(), rbar.detach(), *grads]
    return [tmat.detach(), value.detach(), slope.detach(), rbar.detach(), *grads]


def _rows(nc: int, n: int, dtype: torch.dtype, strided: bool, axes: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(nc, axes, n + 3, generator=gen, dtype=torch.float64).to(dtype)
    # the descriptor hands over column slices of (B, A, nnei), and (B, n, A) transposed
    return full[:, :, 1 : n + 1] if strided else full[:, :, :n].contiguous()


@needs_kernels
@pytest.mark.parametrize(
    "neuron, resnet_dt",
    [
        ([25, 50, 100], False),
        ([4, 8, 16], True),
        ([2, 4, 4, 8], True),
        ([1, 1, 3], True),
        ([3, 5], False),
    ],
)
@pytest.mark.parametrize("nc, n, block_rows", [(13, 7, 512), (13, 7, 10), (1, 1, 512), (5, 40, 64)])
def test_kernels_match_pytorch_path_float64(
    neuron, resnet_dt, nc, n, block_rows, blas, monkeypatch
):
    """Every skip kind, with and without idt; one block, many blocks, blocks of one centre."""
    monkeypatch.setattr(kernel_nodes, "BLOCK_ROWS", block_rows)
    net = EmbeddingNet(neuron, "tanh", resnet_dt, torch.float64, seed=7)
    rows = _rows(nc, n, torch.float64, strided=True)
    gen = torch.Generator().manual_seed(2)
    cot = [torch.randn(nc, 4, neuron[-1], generator=gen, dtype=torch.float64), None]
    cot[1] = torch.randn(nc, n, 4, generator=gen, dtype=torch.float64)
    compiled = _node_outputs(net, rows, cot, True)
    reference = _node_outputs(net, rows, cot, False)
    for a, b in zip(compiled, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_kernels
@pytest.mark.parametrize("neuron, resnet_dt", [([5, 10, 20], False), ([2, 4, 4, 8], True)])
@pytest.mark.parametrize("nc, n, block_rows", [(13, 7, 10), (5, 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernels_match_pytorch_path_on_two_component_rows(neuron, resnet_dt, nc, n, block_rows,
                                                          dtype, monkeypatch):  # fmt: skip
    """Rows of two components (se_e2_r's ``[s, 1]``): the kernels' A = 2 instance."""
    monkeypatch.setattr(kernel_nodes, "BLOCK_ROWS", block_rows)
    net = EmbeddingNet(neuron, "tanh", resnet_dt, dtype, seed=7)
    rows = _rows(nc, n, dtype, strided=True, axes=2)
    gen = torch.Generator().manual_seed(2)
    cot = [torch.randn(nc, 2, neuron[-1], generator=gen, dtype=torch.float64).to(dtype)]
    cot.append(torch.randn(nc, n, 2, generator=gen, dtype=torch.float64).to(dtype))
    compiled = _node_outputs(net, rows, cot, True)
    reference = _node_outputs(net, rows, cot, False)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for a, b in zip(compiled, reference, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


def _group_row_grads(nets, rows, spans, width, cot, use_kernels):
    """A group's row gradients (B, nnei, ``width``) from the blocks of columns ``spans``
    ((lo, n) per net) of its rows (B, nnei, A), and the gradients of a loss on T and on them
    w.r.t. the nets' parameters, through ``row_grads`` of the kernels or of PyTorch."""
    lib = kernels.load_kernels()
    ops = kernel_nodes.KernelEmbedding(lib) if use_kernels else TorchEmbedding()
    blocks, tmat, params = [], 0.0, []
    for net, (lo, n) in zip(nets, spans, strict=True):
        layout, p = layer_layout(net.layers), layer_params(net.layers)
        cols = rows[:, lo : lo + n].transpose(1, 2)
        if use_kernels:
            plan = plan_blocks(None, rows.shape[0], n)
            t_k, value, slope = _KernelEmbedContract.apply(cols, lib, plan, layout, *p)
        else:
            plan = None
            t_k, value, slope = _EmbedContract.apply(cols, layout, *p)
        blocks.append(EmbeddedBlock(value, slope, 0, lo, n, plan))
        tmat, params = tmat + t_k, params + p
    rbar = ops.row_grads(torch.tanh(tmat), blocks, rows, width)
    loss = (cot[0] * tmat).sum() + (cot[1] * rbar).sum()
    return [rbar.detach(), *torch.autograd.grad(loss, params)]


@needs_kernels
@pytest.mark.parametrize("axes, width", [(4, 4), (2, 1)])
def test_group_row_grads_of_several_blocks_match_pytorch_path(axes, width):
    """Blocks of a group's columns with gaps before, between and after them (columns no net
    evaluates: row gradient 0), three of them (their T̄ parts summed), and se_e2_r's rows
    whose row gradient keeps only the first of their two columns."""
    nc, nnei, spans = 9, 16, [(2, 3), (6, 4), (11, 2)]
    nets = [EmbeddingNet([4, 8], "tanh", False, torch.float64, seed=k) for k in range(3)]
    gen = torch.Generator().manual_seed(8)
    rows = torch.randn(nc, nnei, axes, generator=gen, dtype=torch.float64)
    cot = [torch.randn(nc, axes, 8, generator=gen, dtype=torch.float64)]
    cot.append(torch.randn(nc, nnei, width, generator=gen, dtype=torch.float64))
    compiled = _group_row_grads(nets, rows, spans, width, cot, True)
    reference = _group_row_grads(nets, rows, spans, width, cot, False)
    assert compiled[0].shape == (nc, nnei, width)
    for lo, hi in [(0, 2), (5, 6), (10, 11), (13, 16)]:
        assert (compiled[0][:, lo:hi] == 0).all()
    for a, b in zip(compiled, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_kernels
def test_kernels_refuse_rows_of_other_widths():
    net = EmbeddingNet([4, 8], "tanh", False, torch.float64, seed=7)
    rows = _rows(3, 5, torch.float64, strided=False, axes=3)
    plan = plan_blocks(None, 3, 5)
    with pytest.raises(RuntimeError, match="embedding forward: status 2"):
        _KernelEmbedContract.apply(
            rows, kernels.load_kernels(), plan, layer_layout(net.layers), *layer_params(net.layers)
        )


@needs_kernels
@pytest.mark.parametrize("block_rows", [512, 12])
def test_sorted_blocks_skip_padded_slots(block_rows, blas, monkeypatch):
    """With ``used``, centres are sorted into blocks that evaluate only their own leading slots:
    T and the parameter gradients equal the PyTorch path's on rows whose other slots are zero
    (no share of T), and the row gradients of those slots are 0."""
    monkeypatch.setattr(kernel_nodes, "BLOCK_ROWS", block_rows)
    net = EmbeddingNet([4, 8, 16], "tanh", True, torch.float64, seed=5)
    nc, n = 17, 9
    rows = _rows(nc, n, torch.float64, strided=True)
    used = torch.randint(0, n + 1, (nc,), generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(nc, 4, 16, generator=gen, dtype=torch.float64)]
    cot.append(torch.randn(nc, n, 4, generator=gen, dtype=torch.float64))
    compiled = _node_outputs(net, rows, cot, True, used=used)
    widths = plan_blocks(used, nc, n).widths
    assert (widths >= used).all()
    if block_rows == 12:  # blocks of one or two centres: some narrower than n
        assert (widths < n).any()
    outside = torch.arange(n).view(1, n) >= widths.view(nc, 1)  # (B, n) slots not evaluated
    cleared = rows.masked_fill(outside.unsqueeze(1), 0.0)
    cot[1] = cot[1].masked_fill(outside.unsqueeze(-1), 0.0)
    reference = _node_outputs(net, cleared, cot, False)
    tmat, rbar, *grads = compiled
    torch.testing.assert_close(tmat, reference[0], rtol=1e-12, atol=1e-12)
    assert (rbar[outside] == 0).all()
    torch.testing.assert_close(rbar[~outside], reference[3][~outside], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, reference[4:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_kernels
def test_kernels_match_pytorch_path_float32(blas, monkeypatch):
    net = EmbeddingNet([25, 50, 100], "tanh", True, torch.float32, seed=7)
    rows = _rows(19, 30, torch.float32, strided=False)
    gen = torch.Generator().manual_seed(3)
    cot = [torch.randn(19, 4, 100, generator=gen), torch.randn(19, 30, 4, generator=gen)]
    compiled = _node_outputs(net, rows, cot, True)
    reference = _node_outputs(net, rows, cot, False)
    for a, b in zip(compiled, reference, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


@needs_kernels
def test_kernels_same_result_on_one_and_two_threads(blas, monkeypatch):
    """The threads' partial gradients are summed in a fixed order: only the rounding of that
    sum may differ between thread counts."""
    net = EmbeddingNet([25, 50, 100], "tanh", False, torch.float64, seed=1)
    rows = _rows(40, 20, torch.float64, strided=True)
    gen = torch.Generator().manual_seed(4)
    cot = [torch.randn(40, 4, 100, generator=gen, dtype=torch.float64)]
    cot.append(torch.randn(40, 20, 4, generator=gen, dtype=torch.float64))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _node_outputs(net, rows, cot, True)
        torch.set_num_threads(2)
        two = _node_outputs(net, rows, cot, True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


@pytest.fixture
def fresh_kernels(monkeypatch):
    """Forget the loaded kernels (and which warnings were given) for the test's duration."""
    from mdtrain.model import backend

    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(backend, "_announced", set())


def test_missing_compiler_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, fresh_kernels):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MDTRAIN_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="mdtrain.model"):
        models = [build_model(small_config()) for _ in range(2)]
    warnings = [r for r in caplog.records if "kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
    assert [m.backend for m in models] == ["fused", "fused"]  # the next choice, still fast
    with pytest.raises(MDTrainError, match="backend 'kernels' cannot run here.*no-such-compiler"):
        build_model(small_config(), backend="kernels")  # forced: an error, never a fallback


@needs_kernels
def test_openblas_thread_setting_is_restored():
    """numpy's OpenBLAS has only a process-wide thread count, which the kernels set to 1 while
    their own threads call it: numpy gets its setting back afterwards."""
    entry = kernels._numpy_openblas()
    if entry is None:
        pytest.skip("numpy's OpenBLAS is not usable here")
    set_threads, get_threads = entry[4], entry[5]
    loaded = kernels.load_kernels()
    before_blas, before_threads = loaded.blas, get_threads()
    try:
        loaded.use_blas("openblas")
        set_threads(2)
        net = EmbeddingNet([4, 8, 16], "tanh", False, torch.float64, seed=0)
        rows = _rows(40, 30, torch.float64, strided=False)
        cot = [torch.ones(40, 4, 16, dtype=torch.float64), torch.ones(40, 30, 4)]
        _node_outputs(net, rows, cot, True)
        assert get_threads() == 2
    finally:
        set_threads(before_threads)
        loaded.use_blas(before_blas)


@needs_kernels
def test_unknown_blas_is_refused():
    with pytest.raises(RuntimeError, match="MDTRAIN_BLAS='mkl'"):
        kernels.load_kernels().use_blas("mkl")


@needs_kernels
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    """A second build finds the first; nothing but the library is left in the cache; another
    source is another library. The build's logic on a one-function source: the kernels' own
    sources are compiled (once per cache) and run by every other test here, so a second
    ``-O3`` build of them in a fresh cache (tens of seconds of CPU) would test nothing more."""
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text('extern "C" int mdtrain_tiny(int x) { return 2 * x; }\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv("MDTRAIN_CACHE_DIR", str(cache))
    monkeypatch.setattr(build, "SOURCES", [source])
    first = build.build(os.environ.get("CXX", "c++"))
    mtime = first.stat().st_mtime_ns
    second = build.build(os.environ.get("CXX", "c++"))
    assert first == second and second.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in cache.iterdir()) == [first.name]
    assert ctypes.CDLL(str(first)).mdtrain_tiny(21) == 42  # a library that loads and runs
    source.write_text(source.read_text().replace("2 * x", "3 * x"))
    third = build.build(os.environ.get("CXX", "c++"))
    assert third != first and ctypes.CDLL(str(third)).mdtrain_tiny(21) == 63


_BAD_ALLOC_SCRIPT = """
import json, resource, torch
torch.set_num_threads(2)
from mdtrain.memory import is_oom_error
from mdtrain.model.accel import kernel_nodes, kernels
from mdtrain.model.accel.kernel_nodes import _KernelEmbedContract, plan_blocks
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.network import EmbeddingNet

lib = kernels.load_kernels()
net = EmbeddingNet([25, 50, 100], "tanh", False, torch.float64, seed=0)
params, layout = layer_params(net.layers), layer_layout(net.layers)
rows = torch.randn(4000, 4, 30, dtype=torch.float64)
tmat, _, _ = _KernelEmbedContract.apply(rows, lib, plan_blocks(None, 4000, 30), layout, *params)
cot = torch.randn_like(tmat)
torch.autograd.grad(tmat, params, cot)  # warm: lazy imports and buffers
kernel_nodes.BLOCK_ROWS = 10**6  # one block per thread: the backward's scratch is ~300 MB
tmat, _, _ = _KernelEmbedContract.apply(rows, lib, plan_blocks(None, 4000, 30), layout, *params)
size = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
limit = size * 1024 + (1 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    torch.autograd.grad(tmat, params, cot)
    print(json.dumps({"raised": None}))
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "text": str(exc), "oom": is_oom_error(exc)}))
"""


@needs_kernels
@pytest.mark.multiprocess
def test_allocation_failure_inside_the_kernels_is_a_recoverable_oom():
    """A real std::bad_alloc in an OpenMP region (address-space limit in a child process)
    comes back as a MemoryError, not a terminated process."""
    import json
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("needs /proc/self/status")
    proc = subprocess.run(
        [sys.executable, "-c", _BAD_ALLOC_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["raised"] == "MemoryError" and report["oom"], report
    assert "std::bad_alloc" in report["text"] and "embedding backward" in report["text"]


_BLAS_BUFFER_SCRIPT = """
import resource, torch
torch.set_num_threads(2)
from mdtrain.model.accel.kernel_nodes import _KernelEmbedContract, plan_blocks
from mdtrain.model.accel.kernels import load_kernels
from mdtrain.model.accel.layout import layer_layout, layer_params
from mdtrain.model.network import EmbeddingNet

lib = load_kernels()
lib.use_blas("openblas")
net = EmbeddingNet([25, 50, 100], "tanh", False, torch.float64, seed=0)
rows = torch.randn(2000, 4, 30, dtype=torch.float64)
room = [torch.empty(10**8 // 8, dtype=torch.float64) for _ in range(4)]  # for the tape
size = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
limit = size * 1024 + (8 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
del room
layout, params = layer_layout(net.layers), layer_params(net.layers)
_KernelEmbedContract.apply(rows, lib, plan_blocks(None, 2000, 30), layout, *params)
print("ran")
"""


@needs_kernels
@pytest.mark.multiprocess
def test_kernels_blas_buffers_are_reserved_before_memory_runs_out():
    """numpy's OpenBLAS ends the process ("Memory allocation still failed after 10 retries")
    when a thread's first product cannot map its buffer: the kernels' threads take theirs
    when the kernels load, so a first product under an address-space limit still runs."""
    import subprocess
    import sys

    if kernels._numpy_openblas() is None or not sys.platform.startswith("linux"):
        pytest.skip("needs numpy's OpenBLAS and /proc/self/status")
    proc = subprocess.run(
        [sys.executable, "-c", _BLAS_BUFFER_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert "OpenBLAS error" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ran"), proc.stderr[-2000:]
