"""Out-of-memory recognition, fault injection and the inference chunker."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from mdtrain import memory
from mdtrain.errors import MDTrainError
from mdtrain.memory import InferenceChunker, is_oom_error, maybe_simulate_oom, release_memory

OOM_MESSAGES = [
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)",
    "CUDA driver error: out of memory",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `cusolverDnCreate(handle)`",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)",
    "run_func_( container_handle_, input_handles.data(), input_handles.size(), ...) API call "
    "failed at /pytorch/torch/csrc/inductor/aoti_runner/model_container_runner.cpp, line 107",
    "The following operation failed in the TorchScript interpreter.\nstd::bad_alloc",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
]

NOT_OOM_MESSAGES = [
    "shape mismatch: value tensor of shape [3] cannot be broadcast to [2]",
    "Expected memory format ChannelsLast, got Contiguous",
    "unsupported memory format option Preserve",
    "CUDA error: an illegal memory access was encountered",
    "cuda out of memory",  # not how PyTorch prints it
    "run_func_( failed",  # only half of the AOTInductor wrapper
    # not initialised for another reason than a failed handle allocation
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasSgemm( handle, ...)`",
]


def _raise(exc: BaseException) -> None:
    raise exc


def _caught(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return exc
    raise AssertionError("nothing was raised")


# ------------------------------------------------------------------ recognition
def test_cuda_oom_class_is_the_generic_one_or_a_subclass():
    assert issubclass(torch.cuda.OutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(torch.OutOfMemoryError, RuntimeError)


def test_oom_types_are_recognised():
    assert is_oom_error(torch.OutOfMemoryError("anything"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("anything"))
    assert is_oom_error(MemoryError())


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_oom_texts_are_recognised(message):
    assert is_oom_error(RuntimeError(message))

    class WrappedError(RuntimeError):
        pass

    assert is_oom_error(WrappedError(message))


@pytest.mark.parametrize("message", NOT_OOM_MESSAGES)
def test_other_runtime_errors_are_not_oom(message):
    assert not is_oom_error(RuntimeError(message))


@pytest.mark.parametrize(
    "exc",
    [ValueError("CUDA out of memory."), KeyError("x"), TypeError("bad"), OSError(12, "no")],
)
def test_other_types_are_not_oom_even_with_the_text(exc):
    assert not is_oom_error(exc)


def test_real_cpu_allocation_failure_is_recognised():
    # 2**53 bytes exceeds any address space: the allocator refuses at once
    exc = _caught(lambda: torch.empty(2**25, 2**25, dtype=torch.float64))
    assert "DefaultCPUAllocator" in str(exc)
    assert is_oom_error(exc)


def test_explicit_cause_is_followed():
    def chained():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        except RuntimeError as err:
            raise ValueError("evaluation failed") from err

    exc = _caught(chained)
    assert isinstance(exc, ValueError)
    assert is_oom_error(exc)


def test_implicit_context_is_followed_through_several_levels():
    def chained():
        try:
            try:
                raise RuntimeError("CUDA error: out of memory")
            except RuntimeError:
                raise KeyError("while handling")  # noqa: B904
        except KeyError:
            raise TypeError("outer")  # noqa: B904

    exc = _caught(chained)
    assert isinstance(exc, TypeError)
    assert is_oom_error(exc)


def test_from_none_suppresses_the_context():
    def suppressed():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError:
            raise ValueError("unrelated") from None

    assert not is_oom_error(_caught(suppressed))


def test_chain_cycles_terminate():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not is_oom_error(a)
    c = RuntimeError("c")
    c.__cause__ = c
    assert not is_oom_error(c)
    d, e = ValueError("d"), RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
    d.__cause__, e.__context__ = e, d
    assert is_oom_error(d)


def test_final_verdicts_and_interrupts_are_never_oom():
    def verdict():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError:
            raise MDTrainError("system s: a single frame of 9 atoms does not fit")  # noqa: B904

    def interrupted():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError:
            raise KeyboardInterrupt  # noqa: B904

    assert not is_oom_error(_caught(verdict))
    assert not is_oom_error(_caught(interrupted))


def test_broken_str_does_not_hide_anything():
    class Weird(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    assert not is_oom_error(Weird())


# TorchScript wraps errors raised inside a scripted function in its own layout. Scripting warns
# that torch.jit.script is deprecated: silenced here only, the filters come back afterwards.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)

    @torch.jit.script
    def _scripted_oom(x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x

    @torch.jit.script
    def _scripted_value_error(x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            raise ValueError("memory format is wrong")
        return x

    @torch.jit.script
    def _scripted_alloc(n: int) -> torch.Tensor:
        return torch.empty(n, n, dtype=torch.float64)


def test_torchscript_wrapped_oom_is_recognised():
    exc = _caught(lambda: _scripted_oom(torch.ones(2)))
    assert isinstance(exc, torch.jit.Error)  # not a RuntimeError on this build
    assert "TorchScript interpreter" in str(exc)
    assert is_oom_error(exc)
    assert not is_oom_error(_caught(lambda: _scripted_value_error(torch.ones(2))))


def test_real_allocation_failure_inside_torchscript_is_recognised():
    exc = _caught(lambda: _scripted_alloc(2**25))
    assert "TorchScript" in str(exc)
    assert is_oom_error(exc)


def test_release_memory_collects_garbage(monkeypatch):
    calls = []
    monkeypatch.setattr(memory.gc, "collect", lambda: calls.append(1) or 0)
    release_memory()
    assert calls == [1]


# ------------------------------------------------------------------ fault injection
def test_no_simulation_without_env(monkeypatch):
    monkeypatch.delenv(memory.SIMULATE_ATOMS_ENV, raising=False)
    maybe_simulate_oom(10**9, 0)


def test_simulation_threshold_is_strictly_more_than_n(monkeypatch):
    monkeypatch.setenv(memory.SIMULATE_ATOMS_ENV, "100")
    monkeypatch.delenv(memory.SIMULATE_RANKS_ENV, raising=False)
    maybe_simulate_oom(100, 0)
    exc = _caught(lambda: maybe_simulate_oom(101, 0))
    assert isinstance(exc, torch.OutOfMemoryError)
    assert memory.SIMULATE_ATOMS_ENV in str(exc)
    assert is_oom_error(exc)


def test_simulation_restricted_to_ranks(monkeypatch):
    monkeypatch.setenv(memory.SIMULATE_ATOMS_ENV, "10")
    monkeypatch.setenv(memory.SIMULATE_RANKS_ENV, "1,3")
    for rank in (0, 2, 4):
        maybe_simulate_oom(11, rank)
    for rank in (1, 3):
        assert is_oom_error(_caught(lambda r=rank: maybe_simulate_oom(11, r)))
    monkeypatch.setenv("RANK", "3")
    assert is_oom_error(_caught(lambda: maybe_simulate_oom(11)))
    monkeypatch.setenv("RANK", "2")
    maybe_simulate_oom(11)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (memory.SIMULATE_ATOMS_ENV, "lots"),
        (memory.SIMULATE_ATOMS_ENV, "-3"),
        (memory.SIMULATE_RANKS_ENV, "a"),
    ],
)
def test_bad_simulation_env_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(memory.SIMULATE_ATOMS_ENV, "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(MDTrainError, match=name):
        maybe_simulate_oom(5, 0)


# ------------------------------------------------------------------ inference chunker
class FakeDevice:
    """fn(start, stop) that fails with OOM above ``capacity`` atoms and records every call."""

    def __init__(self, natoms: int, capacity: int) -> None:
        self.natoms, self.capacity = natoms, capacity
        self.calls: list[tuple[int, int, bool]] = []

    def __call__(self, start: int, stop: int) -> list[int]:
        fits = (stop - start) * self.natoms <= self.capacity
        self.calls.append((start, stop, fits))
        if not fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return list(range(start, stop))


@pytest.fixture
def no_infer_env(monkeypatch):
    monkeypatch.delenv(memory.INFER_BATCH_ENV, raising=False)
    monkeypatch.delenv(memory.INFER_BATCH_ENV_COMPAT, raising=False)


def _flatten(chunks):
    return [i for chunk in chunks for i in chunk]


def test_chunker_grows_while_it_fits(no_infer_env):
    dev = FakeDevice(natoms=8, capacity=10**9)
    chunker = InferenceChunker(start_atoms=64, max_atoms=1024, device="cpu")
    out = chunker.run_all(dev, nitems=500, natoms_per_item=8)
    assert _flatten(out) == list(range(500))
    sizes = [stop - start for start, stop, _ in dev.calls]
    assert sizes[:5] == [8, 16, 32, 64, 128]
    assert max(sizes) * 8 <= 1024
    assert chunker.current == 1024


def test_chunker_halves_on_oom_and_remembers(no_infer_env):
    dev = FakeDevice(natoms=10, capacity=300)
    chunker = InferenceChunker(start_atoms=1024, max_atoms=10**6, device="cuda")
    out = chunker.run_all(dev, nitems=200, natoms_per_item=10)
    assert _flatten(out) == list(range(200))
    tried = [(stop - start) for start, stop, _ in dev.calls]
    assert tried[:3] == [102, 51, 25]  # 1020 and 510 atoms fail, 250 fits
    assert chunker.oom_count == 2
    # a size that failed is never tried again, so the rest of the run has no failure
    assert all(fits for _, _, fits in dev.calls[2:])
    dev.calls.clear()
    chunker.run_all(dev, nitems=100, natoms_per_item=10)
    assert all(fits for _, _, fits in dev.calls)


def test_chunker_retries_with_memory_released(no_infer_env, monkeypatch):
    released = []
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(1))
    dev = FakeDevice(natoms=1, capacity=100)
    InferenceChunker(start_atoms=400, max_atoms=400, device="cpu").run_all(dev, 400, 1)
    assert len(released) == sum(not fits for _, _, fits in dev.calls) == 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("env_name", [memory.INFER_BATCH_ENV, memory.INFER_BATCH_ENV_COMPAT])
def test_env_is_start_and_upper_bound(no_infer_env, monkeypatch, device, env_name):
    monkeypatch.setenv(env_name, "256")
    dev = FakeDevice(natoms=4, capacity=10**9)
    chunker = InferenceChunker(device=device)
    chunker.run_all(dev, nitems=2000, natoms_per_item=4)
    sizes = {stop - start for start, stop, _ in dev.calls}
    assert max(sizes) == 64  # 256 atoms, never more
    assert chunker.current == 256


def test_project_env_name_wins_over_compat_name(no_infer_env, monkeypatch):
    monkeypatch.setenv(memory.INFER_BATCH_ENV, "32")
    monkeypatch.setenv(memory.INFER_BATCH_ENV_COMPAT, "4096")
    assert InferenceChunker(device="cpu").max_atoms == 32


def test_default_bounds(no_infer_env):
    cpu = InferenceChunker(device="cpu")
    assert cpu.current == cpu.max_atoms == memory.CPU_MAX_ATOMS == 1024  # no growth on a CPU
    gpu = InferenceChunker(device="cuda")
    assert gpu.current == 1024 and gpu.max_atoms > 10**6
    dev = FakeDevice(natoms=1, capacity=10**9)
    gpu.run_all(dev, nitems=20000, natoms_per_item=1)
    assert max(stop - start for start, stop, _ in dev.calls) > 1024


def test_single_item_that_does_not_fit_is_a_user_error(no_infer_env):
    dev = FakeDevice(natoms=500, capacity=300)
    chunker = InferenceChunker(start_atoms=4096, max_atoms=4096, device="cuda")
    with pytest.raises(MDTrainError, match=r"system water/set\.0: a single frame of 500 atoms"):
        chunker.run_all(dev, nitems=20, natoms_per_item=500, name="water/set.0")
    assert [stop - start for start, stop, _ in dev.calls] == [8, 4, 2, 1]


def test_non_oom_errors_propagate(no_infer_env):
    def broken(start, stop):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        InferenceChunker(device="cpu").run_all(broken, 10, 3)


def test_empty_run(no_infer_env):
    assert InferenceChunker(device="cpu").run_all(lambda a, b: 1 / 0, 0, 3) == []


_RLIMIT_SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    torch.set_num_threads(1)
    from mdtrain.memory import InferenceChunker

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2048, 64, dtype=torch.float64, generator=gen)
    w = torch.rand(64, 65536, dtype=torch.float64, generator=gen)  # a row of x @ w is 512 KiB
    expected = x @ w.sum(1)
    seen = []

    def rowsums(start, stop):
        try:
            return (x[start:stop] @ w).sum(1)
        except RuntimeError as exc:
            seen.append(str(exc))
            raise

    def vmsize():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    rowsums(0, 8)  # warm up the code paths before measuring
    limit = vmsize() + 300 * 2**20  # chunks of 1024 rows (512 MiB) cannot fit
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    chunker = InferenceChunker(start_atoms=1024, max_atoms=2048, device="cpu")
    got = torch.cat(chunker.run_all(rowsums, 2048, 1))
    print(json.dumps({
        "ok": bool(torch.allclose(got, expected, rtol=1e-12, atol=0)),
        "oom_count": chunker.oom_count,
        "current": chunker.current,
        "seen": seen,
    }))
    """
)


@pytest.mark.multiprocess
def test_real_cpu_oom_under_address_space_limit_is_recovered():
    pytest.importorskip("resource")
    if not sys.platform.startswith("linux"):
        pytest.skip("needs /proc/self/status")
    proc = subprocess.run(
        [sys.executable, "-c", _RLIMIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"]
    assert report["oom_count"] >= 1
    assert report["seen"] and all("DefaultCPUAllocator" in s for s in report["seen"])
    assert report["current"] * 512 * 1024 < 300 * 2**20


def test_oom_site_names_the_innermost_mdtrain_line_and_the_message():
    from mdtrain.memory import oom_site
    from mdtrain.model.accel.kernels import _check

    exc = _caught(lambda: _check(1, "embedding backward"))
    site = oom_site(exc)
    assert site.startswith("kernels.py:") and "embedding backward: std::bad_alloc" in site
    assert oom_site(RuntimeError("CUDA out of memory.\nmore")) == "CUDA out of memory."
