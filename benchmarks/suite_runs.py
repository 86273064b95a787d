"""The suite's plumbing: the inputs of timed runs, the environment of a child process, step
times read from a log, the alternating rounds and the table rows built from them, and the
machine description. Used by ``suite_parts`` (the measurements) and ``suite`` (the command).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable

from neighbor_stat import ChildFailed, ChildRun

# training keys of mdtrain's schema that DeePMD-kit 3.2's strict input check rejects
MDTRAIN_ONLY = (
    "distributed", "neighbor_stat_file", "strict_sel", "restart", "batch_controller",
    "nlist_prefetch",
)  # fmt: skip
DP_STEP = re.compile(r"Batch\s+(\d+): total wall time")
MDTRAIN_STEP = re.compile(r"^INFO step (\d+)/\d+")
Runner = Callable[[], dict]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- inputs and processes
def thread_env(threads: int) -> dict[str, str]:
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "DP_INTRA_OP_PARALLELISM_THREADS": n}


def timing_input(config: dict, base: str, steps: int, precision: str, deepmd: bool) -> dict:
    """A copy of the input for one timed run of ``steps`` steps (see the module docstring);
    relative paths are resolved against ``base``, the input's directory."""

    def absolute(path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(base, path)

    config = copy.deepcopy(config)
    for section in ("descriptor", "fitting_net"):
        config["model"][section]["precision"] = precision
    training = config["training"]
    for key in ("validation_data", "stat_file", "restart", "stop_batch", "num_steps"):
        training.pop(key, None)
    data = training["training_data"]
    systems = data["systems"]
    data["systems"] = absolute(systems) if isinstance(systems, str) else [*map(absolute, systems)]
    data["batch_size"] = 1
    training.update(numb_steps=steps, disp_freq=1, save_freq=10**9)
    if training.get("neighbor_stat_file"):
        training["neighbor_stat_file"] = absolute(training["neighbor_stat_file"])
    for key in MDTRAIN_ONLY if deepmd else ():
        training.pop(key, None)
    return config


def write_input(config: dict, directory: str) -> str:
    path = os.path.join(directory, "input.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=1)
    return path


def step_times(run: ChildRun, pattern: re.Pattern, warmup: int, steps: int) -> list[float]:
    """Seconds per step after ``warmup``, from the arrival times of the log lines that
    ``pattern`` marks with their step number (printed after every step)."""
    marks: dict[int, float] = {}
    for t, line in run.lines:
        found = pattern.search(line)
        if found:
            marks.setdefault(int(found.group(1)), t)
    wanted = range(warmup, warmup + steps + 1)
    missing = [k for k in wanted if k not in marks]
    if missing:
        raise ChildFailed(f"steps {missing[:5]} not found in the log of {run.command[0]}")
    return [marks[k + 1] - marks[k] for k in wanted[:-1]]


def costs(run: ChildRun) -> dict:
    return {"wall_s": run.wall_s, "cpu_s": run.cpu_s, "peak_rss_mib": run.peak_rss_mib}


def machine_info(deepmd_env: str | None) -> dict:
    """CPU, memory and the versions of everything measured."""
    cpuinfo = _read("/proc/cpuinfo").splitlines()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    mem = re.search(r"MemTotal:\s+(\d+)", _read("/proc/meminfo"))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)

    info = {
        "cpu": models[0] if models else platform.processor(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "mdtrain": importlib.metadata.version("mdtrain"),
        "mdtrain_commit": git("rev-parse", "--short", "HEAD").stdout.strip() or None,
        "mdtrain_modified": git("diff", "--quiet", "HEAD", "--", "mdtrain").returncode == 1,
    }
    if deepmd_env:
        code = "import importlib.metadata as m; print(m.version('deepmd-kit'), m.version('torch'))"
        python = os.path.join(deepmd_env, "bin", "python")
        out = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.split()
        info["deepmd_kit"], info["deepmd_torch"] = (out + [None, None])[:2]
    return info


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return ""


# ---------------------------------------------------------------- rounds and rows
def alternate(label: str, repeat: int, runners: dict[str, Runner]) -> dict:
    """Call the runners in turn for ``repeat`` rounds. A runner that fails is not called
    again. Returns {name: [result of each round] | {"error": first line}}."""
    results: dict = {name: [] for name in runners}
    for r in range(repeat):
        for name, runner in runners.items():
            if isinstance(results[name], dict):
                continue
            try:
                result = runner()
            except (ChildFailed, RuntimeError) as exc:
                log(f"[{label}] {name} failed: {exc}")
                results[name] = {"error": str(exc).splitlines()[0]}
                continue
            result["load_1min"] = os.getloadavg()[0]
            results[name].append(result)
            shown = [f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float)]
            log(f"[{label}] round {r + 1}/{repeat} {name}: {', '.join(shown)}")
    return results


def row(what: str, unit: str, kind: str, md: object, dp: object, key: str) -> dict:
    """A table row: ``key`` of every round of mdtrain (``md``) and DeePMD-kit (``dp``).
    ``kind`` "cost" (time, memory; ratio dp/mdtrain) or "rate" (frames/s; mdtrain/dp), so
    that a ratio above 1 always favours mdtrain."""

    def figure(results: object) -> object:
        if not isinstance(results, list):
            return results  # None (not run), "n/a ..." or {"error": ...}
        values = [r[key] for r in results if r.get(key) is not None]
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values),
                "values": values}  # fmt: skip

    out = {"what": what, "unit": unit, "mdtrain": figure(md), "deepmd": figure(dp), "ratio": None}
    if isinstance(md, list) and isinstance(dp, list) and md and len(md) == len(dp):
        pairs = [(a.get(key), b.get(key)) for a, b in zip(md, dp)]
        ratios = [b / a if kind == "cost" else a / b for a, b in pairs if a and b]
        out["ratio"] = statistics.median(ratios) if ratios else None
    return out
