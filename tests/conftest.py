"""Shared fixtures: small labelled water-like systems in deepmd/npy and deepmd/hdf5, and the
background training runs of the preemption and rank-failure tests; the session's settings."""

from __future__ import annotations

import compileall
import contextlib
import copy
import gc
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.datagen import (
    lj_labels,
    random_water_like,
    water_labeled,
    write_hdf5_system,
    write_npy_system,
)


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread for the whole session: the small models of the tests run faster so on
    a shared machine, and thread-count-dependent rounding cannot differ between runs. Processes
    the tests start choose their own (``clean_env`` sets OMP_NUM_THREADS). OMP_NUM_THREADS=1
    unless set: xdist's workers (started after this) inherit it, so the two workers of ``-n 2``
    do not each take every core, and a training run inside a test (``main(["train", ...])``)
    keeps the one thread instead of choosing the machine's cores (``select_device``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        import torch  # here, not at the top: xdist's controller runs no test, so needs no torch

        torch.set_num_threads(1)
    if not hasattr(config, "workerinput"):  # once per session, before xdist starts workers
        _precompile(config.rootpath)
        _build_kernels(config.rootpath)


def _build_kernels(root: Path) -> None:
    """The compiled kernels built once, before the workers start, where the cache may lack
    them. Otherwise, with a cold cache (a first run on a machine, or new kernel sources), the
    first users compiled them all at once, each its own copy (tens of seconds of CPU each):
    both workers and the ranks of the multi-process tests they start first. Where the cache
    holds a library newer than every kernel source, nothing is imported (xdist's controller
    runs no test and needs no torch); after a build or a cache hit the library's time stamp
    is renewed, so that the next session skips this."""
    csrc = root / "mdtrain" / "model" / "accel" / "csrc"
    sources = [*csrc.glob("*.cpp"), *csrc.glob("*.h")]
    from mdtrain.cache_dir import cache_dir  # no torch

    newest = max((p.stat().st_mtime for p in sources), default=None)
    built = [p.stat().st_mtime for p in cache_dir().glob("embedding-*.so")]
    if newest is None or any(t > newest for t in built):
        return
    from mdtrain.model.accel import build  # imports torch: only where a build may be due

    # no compiler or no cache here: the tests that need them say so themselves
    with contextlib.suppress(RuntimeError, OSError):
        os.utime(build.build(os.environ.get("CXX", "c++")))


def _precompile(root: Path) -> None:
    """Bytecode for the project's own modules, written once before anything imports them.
    Every process the tests start (a few hundred: ranks, ``mdtrain`` commands, the xdist
    workers) imports mdtrain and the test helpers; where the environment sets
    PYTHONDONTWRITEBYTECODE (this project's machine does), none of them writes a ``.pyc``, so
    each compiled the same sources again. Reading bytecode is still allowed there; it is
    checked against the source's time stamp, so an edited file is compiled afresh, never run
    stale. Up-to-date files cost a stat each."""
    for folder in ("mdtrain", "tests", "benchmarks"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once the tests are collected (torch, mdtrain, the test modules and their
    parameters: a few hundred thousand objects, alive for the whole session) is moved out of
    the garbage collector's sight (``gc.freeze``). Every out-of-memory recovery calls
    ``gc.collect()`` (``mdtrain.memory.release_memory``), and the tests simulate hundreds of
    them: each walked that whole heap again (0.15 s apiece in a worker that has imported torch
    and the exporters), as did Python's own full collections. Objects made later, by the
    tests, are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n`` (pytest-xdist, ``--dist loadgroup``), tests that share a set-up wider than
    one test run in one worker, so the set-up is made once: a module's tests that use a
    module-scoped fixture go together, and every test that uses a session fixture of the
    project (``reference_run``) goes with the others using it. The rest are spread one by
    one. Runs before xdist reads the ``xdist_group`` marks; an explicit mark wins."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = _shared_setup_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the schedule's
        items[:] = _process_heavy_first(items)


def _process_heavy_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """Work units (a group, or one test) with a ``multiprocess`` test first, the rest after,
    each in collection order. xdist hands units out in this order (``--no-loadscope-reorder``
    in pyproject.toml), so the minute-long multi-process tests start early on both workers and
    the many short tests fill the end: otherwise the long ones of ``tests/train/`` came last,
    and one worker ran them alone minutes after the other had finished."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        name = (mark.kwargs.get("name") or mark.args[0]) if mark else item.nodeid
        units.setdefault(name, []).append(item)
    order = sorted(
        units.values(), key=lambda u: not any(i.get_closest_marker("multiprocess") for i in u)
    )
    return [item for unit in order for item in unit]


def _shared_setup_group(item: pytest.Item) -> str | None:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    group = None
    for name in info.names_closure:
        fixture = info.name2fixturedefs.get(name, ())[-1:]
        if not fixture or fixture[0].scope == "function" or not fixture[0].baseid:
            continue  # per test, or a plugin's own (tmp_path_factory): nothing to share
        if fixture[0].scope == "session":
            return name
        group = item.nodeid.split("::")[0]
    return group


@cache
def _water(nframes: int, seed: int, triclinic: bool) -> dict:
    return water_labeled(nframes=nframes, seed=seed, triclinic=triclinic)


@pytest.fixture
def water_data() -> dict:
    """Six labelled frames of 8 water-like molecules (24 atoms) in a 6.4 Å cubic box, rcut 4.

    Keys are the writers' keyword arguments: coords, types (O H H ... order), type_map
    ["O", "H"], boxes, energy, force, virial. A fresh copy per test.
    """
    return copy.deepcopy(_water(6, 0, False))


@pytest.fixture
def water_system(tmp_path, water_data) -> str:
    """``water_data`` as a deepmd/npy directory in two sets (4 + 2 frames)."""
    return write_npy_system(tmp_path / "water", set_size=4, **water_data)


@pytest.fixture
def water_h5(tmp_path, water_data) -> str:
    """``water_data`` as ``water.h5#/water`` (deepmd/hdf5, two sets)."""
    return write_hdf5_system(tmp_path / "water.h5", "water", set_size=4, **water_data)


@pytest.fixture
def water_triclinic(tmp_path) -> str:
    """Six labelled frames in a triclinic cell, deepmd/npy, one set."""
    return write_npy_system(tmp_path / "water_tri", **copy.deepcopy(_water(6, 1, True)))


@pytest.fixture
def water_nopbc(tmp_path) -> str:
    """Four labelled frames of a 4-molecule cluster without a cell (``nopbc``), no virial."""
    coords, types, _ = random_water_like(4, 4, 6.0, seed=2)
    energy, force, _ = lj_labels(coords, types, None, rcut=4.0)
    return write_npy_system(
        tmp_path / "cluster", coords, types, ["O", "H"], None, energy=energy, force=force
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True)
def _reset_mdtrain_logger():
    """The CLI configures the ``mdtrain`` logger (own handler, no propagation); undo it after
    each test so that ``caplog`` in later tests sees mdtrain's records."""
    yield
    import logging

    logger = logging.getLogger("mdtrain")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture
def cleanup():
    """``cleanup(launched)`` registers a background run; its session is killed after the test."""
    from tests.helpers.runs import Cleanup  # imports torch: not in xdist's controller

    keeper = Cleanup()
    yield keeper
    keeper.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(nproc) -> (launched, out_dir)``: the uninterrupted run on ``nproc`` ranks,
    started in the background on first use and shared by every test (``finish()`` it)."""
    from tests.helpers.runs import ReferenceRuns

    runs = ReferenceRuns(tmp_path_factory)
    yield runs
    runs.close()
