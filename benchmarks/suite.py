"""Side-by-side benchmark suite: mdtrain, and DeePMD-kit when its environment is given.

    python benchmarks/suite.py DATA [--deepmd-env VENV] [--only PARTS] [--repeat 3]
        [--steps 300] [--warmup 30] [--precision float64 float32] [--threads 2]
        [--test-frames 0] [--quick] [--json FILE] [--keep]

DATA is an ``input.json`` or a directory holding one, with the systems it names below it.
Parts (``--only neighbor-stat,train,test,ranks``; all by default):

- ``neighbor-stat``: ``mdtrain neighbor-stat -s DATA_DIR -r RCUT -t TYPES`` against
  ``dp --pt neighbor-stat`` with the same arguments (every system under the data directory),
  whole process; checks that both find the same minimal distance and neighbour counts;
- ``train``: training step time (median over ``--steps`` steps after ``--warmup``, batch 1,
  per precision) and peak RSS of the whole training process. mdtrain: the real Trainer,
  timed by ``benchmarks/train_step.py``; DeePMD-kit: ``dp --pt train`` with ``disp_freq`` 1,
  each step's time from the arrival times of its "Batch N: total wall time" lines;
- ``test``: frames/s of ``mdtrain test`` (checkpoint, and frozen model) and ``dp --pt test``
  (frozen model, float64 unless --precision starts with float32) on the validation systems
  (else the training systems), for a model trained one step: whole process, and the
  evaluation alone (the time of a run on one frame per system subtracted);
- ``ranks``: ``mdtrain train`` with 1 rank × 2 threads against ``torchrun --standalone
  --nproc_per_node=2 -m mdtrain train`` with 2 ranks × 1 thread (Gloo), whatever
  ``--threads``: frames/s per global step (step times from the log, as for DeePMD-kit).
  DeePMD-kit cannot run this on a CPU-only torch (its torchrun path needs NCCL): n/a.

Each timed command is a fresh process with ``OMP_NUM_THREADS`` (and DeePMD-kit's
``DP_INTRA_OP_PARALLELISM_THREADS``) set to ``--threads``; peak RSS is that process's own
(``wait4``). With ``--deepmd-env`` the programs alternate (mdtrain, DeePMD-kit, mdtrain, ...
for ``--repeat`` rounds) so that both see the same machine load; a ratio is the median over
the rounds of DeePMD-kit's cost over mdtrain's. The inputs of both come from the same
input.json, written to a temporary directory (never next to the data): systems made
absolute, batch size 1, no validation, no stat_file, ``disp_freq`` 1, the step count and
precision of the measurement; DeePMD-kit's copy also drops the keys that only mdtrain knows
(``MDTRAIN_ONLY``). Prints a Markdown table for docs/performance.md; ``--json FILE`` (``-``:
stdout) writes every figure. ``--quick``: 4 steps after 2, one round, 2 test frames.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable

from neighbor_stat import ChildFailed, ChildRun, mdtrain_command, mdtrain_neighbor_stat, run_child
from train_step import find_input, run_measure

PARTS = ("neighbor-stat", "train", "test", "ranks")
# training keys of mdtrain's schema that DeePMD-kit 3.2's strict input check rejects
MDTRAIN_ONLY = ("distributed", "neighbor_stat_file", "strict_sel", "restart", "batch_controller")
DP_STEP = re.compile(r"Batch\s+(\d+): total wall time")
MDTRAIN_STEP = re.compile(r"^INFO step (\d+)/\d+")
NO_DP_RANKS = "n/a: DeePMD-kit's torchrun training asks for NCCL, which a CPU-only torch lacks"
Runner = Callable[[], dict]
FROM_TRAIN_STEP = {"step_median_s": "wall_s_per_step", "step_mean_s": "wall_mean_s",
                   "cpu_s_per_step": "cpu_s_per_step", "peak_rss_mib": "peak_rss_mb"}  # fmt: skip


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


# ---------------------------------------------------------------- the parts
class Suite:
    """The parts; each returns (details for the JSON, table rows)."""

    def __init__(self, args: argparse.Namespace, input_path: str, work: str) -> None:
        self.args, self.input_path, self.work = args, input_path, work
        self.base = os.path.dirname(input_path)
        try:
            with open(input_path, encoding="utf-8") as handle:
                self.config = json.load(handle)
            self.rcut = float(self.config["model"]["descriptor"]["rcut"])
            self.type_map = list(self.config["model"]["type_map"])
            self.config["training"]["training_data"]["systems"]
        except json.JSONDecodeError as exc:
            sys.exit(f"{input_path}: not valid JSON ({exc})")
        except (KeyError, TypeError) as exc:
            sys.exit(f"{input_path}: no key {exc}; the suite needs model.descriptor.rcut, "
                     "model.type_map and training.training_data.systems")  # fmt: skip
        self.dp = os.path.join(args.deepmd_env, "bin", "dp") if args.deepmd_env else None
        self.env = thread_env(args.threads)
        self.count = 0

    def fresh_dir(self, name: str) -> str:
        self.count += 1
        path = os.path.join(self.work, f"{self.count:03d}-{name}")
        os.makedirs(path)
        return path

    def pair(self, md: Runner, dp: Runner) -> dict[str, Runner]:
        return {"mdtrain": md, "deepmd": dp} if self.dp else {"mdtrain": md}

    def neighbor_stat(self) -> tuple[dict, list[dict]]:
        def md() -> dict:
            out = os.path.join(self.fresh_dir("md-nstat"), "neighbor_stat.json")
            run, stat = mdtrain_neighbor_stat(self.base, self.rcut, self.type_map, out, self.env)
            return costs(run) | {k: stat[k] for k in ("min_nbor_dist", "max_nbor_size")}

        def dp() -> dict:
            command = [self.dp, "--pt", "neighbor-stat", "-s", self.base, "-r", str(self.rcut),
                       "-t", *self.type_map]  # fmt: skip
            run = run_child(command, env=self.env, cwd=self.fresh_dir("dp-nstat"))
            text = "\n".join(line for _, line in run.lines)
            dist = re.findall(r"min_nbor_dist: (\S+)", text)
            size = re.findall(r"max_nbor_size: \[([-\d ,]*)\]", text)
            if not (dist and size):
                raise ChildFailed("no min_nbor_dist / max_nbor_size in dp's output")
            sizes = [int(n) for n in re.findall(r"-?\d+", size[-1])]
            return costs(run) | {"min_nbor_dist": float(dist[-1]), "max_nbor_size": sizes}

        res = alternate("neighbor-stat", self.args.repeat, self.pair(md, dp))
        part = {"results": res, "agree": None}
        runs = [res["mdtrain"], res.get("deepmd")]
        if all(isinstance(r, list) and r for r in runs):
            found = [(r["min_nbor_dist"], r["max_nbor_size"]) for r in runs[0] + runs[1]]
            part["agree"] = all(_same(d, found[0][0]) and s == found[0][1] for d, s in found)
        wall = row("neighbour statistics, whole process", "s", "cost", res["mdtrain"],
                   res.get("deepmd"), "wall_s")  # fmt: skip
        return part, [wall]

    def train(self) -> tuple[dict, list[dict]]:
        a = self.args

        def md(precision: str) -> Runner:
            def run() -> dict:
                r = run_measure(self.input_path, precision, a.steps, a.warmup, a.threads, 1)
                return {ours: r[theirs] for ours, theirs in FROM_TRAIN_STEP.items()}

            return run

        def dp(precision: str) -> Runner:
            def run() -> dict:
                directory = self.fresh_dir(f"dp-train-{precision}")
                steps = a.warmup + a.steps
                write_input(timing_input(self.config, self.base, steps, precision, True), directory)
                done = run_child([self.dp, "--pt", "train", "input.json"], self.env, directory)
                times = step_times(done, DP_STEP, a.warmup, a.steps)
                median, mean = statistics.median(times), statistics.fmean(times)
                return {"step_median_s": median, "step_mean_s": mean,
                        "peak_rss_mib": done.peak_rss_mib}  # fmt: skip

            return run

        runners = {}
        for p in a.precision:
            runners |= {f"{name} {p}": r for name, r in self.pair(md(p), dp(p)).items()}
        res = alternate("train", a.repeat, runners)
        rows = []
        for p in a.precision:
            md_res, dp_res = res[f"mdtrain {p}"], res.get(f"deepmd {p}")
            rows += [
                row(f"training step, {p}, batch 1 (median)", "s", "cost", md_res, dp_res,
                    "step_median_s"),
                row(f"training process, {p}: peak RSS", "MiB", "cost", md_res, dp_res,
                    "peak_rss_mib"),
            ]  # fmt: skip
        return {"results": res}, rows

    def test(self) -> tuple[dict, list[dict]]:
        from mdtrain.data import expand_systems, open_system

        a, precision = self.args, self.args.precision[0]
        training = self.config["training"]
        valid = (training.get("validation_data") or {}).get("systems")
        systems = expand_systems(valid or training["training_data"]["systems"], self.base)
        sizes = [open_system(s, self.type_map).nframes for s in systems]
        frames = sum(min(n, a.test_frames or n) for n in sizes)
        mdtrain = mdtrain_command()
        md_dir = self.fresh_dir("md-model")
        write_input(timing_input(self.config, self.base, 1, precision, False), md_dir)
        run_child([*mdtrain, "train", "input.json", "-o", "out"], self.env, md_dir)
        checkpoint = os.path.join(md_dir, "out", "model.ckpt.pt")
        frozen = os.path.join(md_dir, "model.pth")
        run_child([*mdtrain, "freeze", checkpoint, "-o", frozen], self.env, md_dir)
        runners = {
            f"mdtrain {kind}": self._tester([*mdtrain, "test", "-m", model, "-s", *systems],
                                            frames, len(systems))
            for kind, model in (("checkpoint", checkpoint), ("frozen", frozen))
        }  # fmt: skip
        if self.dp:
            runners["deepmd"] = self._dp_tester(systems, precision, frames)
        res = alternate("test", a.repeat, runners)
        rows = []
        figures = [("whole process", "frames_per_s")]
        if frames > len(systems):  # else nothing is left once start-up is subtracted
            figures.append(("evaluation", "eval_frames_per_s"))
        for kind in ("checkpoint", "frozen"):
            md = res[f"mdtrain {kind}"]
            for what, key in figures:
                what = f"test ({kind} model), {what}"
                rows.append(row(what, "frames/s", "rate", md, res.get("deepmd"), key))
            what = f"test ({kind} model), peak RSS"
            rows.append(row(what, "MiB", "cost", md, res.get("deepmd"), "peak_rss_mib"))
        part = {"systems": systems, "frames": frames, "precision": precision, "results": res}
        return part, rows

    def _dp_tester(self, systems: list[str], precision: str, frames: int) -> Runner:
        """``dp --pt test`` of a frozen model trained one step, or a runner that fails."""
        directory = self.fresh_dir("dp-model")
        write_input(timing_input(self.config, self.base, 1, precision, True), directory)
        try:
            run_child([self.dp, "--pt", "train", "input.json"], self.env, directory)
            freeze = [self.dp, "--pt", "freeze", "-c", "model.ckpt.pt", "-o", "frozen.pth"]
            run_child(freeze, self.env, directory)
        except ChildFailed as exc:
            failure = exc

            def fail() -> dict:
                raise ChildFailed(f"DeePMD-kit model: {failure}")

            return fail
        listing = os.path.join(directory, "systems.txt")
        with open(listing, "w", encoding="utf-8") as handle:
            handle.write("\n".join(systems) + "\n")
        model = os.path.join(directory, "frozen.pth")
        return self._tester([self.dp, "--pt", "test", "-m", model, "-f", listing], frames,
                            len(systems))  # fmt: skip

    def _tester(self, command: list[str], frames: int, nsystems: int) -> Runner:
        """Runs ``command -n N`` (frames per system) and ``command -n 1`` (start-up)."""

        def run() -> dict:
            full = run_child([*command, "-n", str(self.args.test_frames)], self.env, self.work)
            one = run_child([*command, "-n", "1"], self.env, self.work)
            extra, saved = frames - nsystems, full.wall_s - one.wall_s
            return costs(full) | {
                "frames_per_s": frames / full.wall_s,
                "startup_wall_s": one.wall_s,
                "eval_frames_per_s": extra / saved if extra > 0 and saved > 0 else None,
            }

        return run

    def ranks(self) -> tuple[dict, list[dict]]:
        a, precision = self.args, self.args.precision[0]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", "-m", "mdtrain"]  # fmt: skip

        def runner(launcher: list[str], threads: int, global_frames: int) -> Runner:
            def run() -> dict:
                directory = self.fresh_dir(f"md-ranks-{global_frames}")
                steps = a.warmup + a.steps
                write_input(timing_input(self.config, self.base, steps, precision, False),
                            directory)  # fmt: skip
                command = [*launcher, "train", "input.json", "-o", "out"]
                done = run_child(command, thread_env(threads), directory)
                step = statistics.median(step_times(done, MDTRAIN_STEP, a.warmup, a.steps))
                return {"step_median_s": step, "frames_per_s": global_frames / step,
                        "peak_rss_mib": done.peak_rss_mib}  # fmt: skip

            return run

        names = ("1 rank x 2 threads", "2 ranks x 1 thread")
        runners = dict(zip(names, (runner(mdtrain_command(), 2, 1), runner(torchrun, 1, 2))))
        res = alternate("ranks", a.repeat, runners)
        one, two = res[names[0]], res[names[1]]
        rows = [
            row(f"training, 1 rank × 2 threads, {precision}", "frames/s", "rate", one, None,
                "frames_per_s"),
            row(f"training, 2 ranks × 1 thread (Gloo), {precision}", "frames/s", "rate", two,
                "n/a" if self.dp else None, "frames_per_s"),
        ]  # fmt: skip
        part = {"precision": precision, "results": res, "deepmd": NO_DP_RANKS if self.dp else None}
        if isinstance(one, list) and isinstance(two, list) and one and len(one) == len(two):
            speedups = [y["frames_per_s"] / x["frames_per_s"] for x, y in zip(one, two)]
            part["speedup_2_ranks"] = statistics.median(speedups)
        return part, rows


def _same(a: float | None, b: float | None) -> bool:
    """Equal minimal distances (DeePMD-kit prints 6 decimals; None: no pair found)."""
    return a == b if a is None or b is None else abs(a - b) <= 1e-6


# ---------------------------------------------------------------- report
def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _cell(figure: object) -> str:
    if figure is None:
        return "—"
    if isinstance(figure, str):
        return figure
    if "error" in figure:
        return f"failed ({figure['error'][:60]})"
    text = _num(figure["median"])
    if len(figure["values"]) > 1:
        text += f" ({_num(figure['min'])}–{_num(figure['max'])})"
    return text


def markdown(report: dict) -> str:
    """Two lines on the machine and the settings, the table, and notes."""
    m, s = report["machine"], report["settings"]
    dp = bool(s["deepmd_env"])
    versions = f"mdtrain {m['mdtrain']} ({m['mdtrain_commit']}"
    versions += ", modified)" if m["mdtrain_modified"] else ")"
    if dp:
        versions += f", DeePMD-kit {m.get('deepmd_kit')} (torch {m.get('deepmd_torch')})"
    load = report["load_average"]
    lines = [
        f"{versions}, torch {m['torch']}; {m['cpu']}, {m['usable_cores']} of {m['cores']} "
        f"cores, {m['memory_gib']} GiB; {report['date']}",
        f"data: {report['input']}; threads per process: {s['threads']}; batch 1; "
        f"{s['steps']} steps after {s['warmup']} of warm-up; {s['repeat']} round(s)"
        f"{', alternating' if dp else ''}; load average {load['before'][0]:.2f} before, "
        f"{load['after'][0]:.2f} after",
        "",
    ]
    header = ["measurement", "mdtrain"] + (["DeePMD-kit", "DeePMD-kit / mdtrain"] if dp else [])
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in report["table"]:
        cells = [f"{r['what']} ({r['unit']})", _cell(r["mdtrain"])]
        if dp:
            cells += [_cell(r["deepmd"]), "—" if r["ratio"] is None else f"{_num(r['ratio'])}×"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if dp:
        notes.append("Ratios: DeePMD-kit's time or memory over mdtrain's (for frames/s, "
                     "mdtrain's rate over DeePMD-kit's), median of the rounds; above 1, "
                     "mdtrain is faster or smaller.")  # fmt: skip
    nstat = report["parts"].get("neighbor-stat", {})
    md_runs = nstat.get("results", {}).get("mdtrain")
    if isinstance(md_runs, list) and md_runs:
        first, agree = md_runs[0], nstat["agree"]
        dist = first["min_nbor_dist"]
        said = {None: "", True: "; DeePMD-kit finds the same", False: "; DeePMD-kit DIFFERS"}
        notes.append(f"Neighbour statistics: min_nbor_dist "
                     f"{'undefined' if dist is None else f'{dist:.6f} Å'}, max_nbor_size "
                     f"{first['max_nbor_size']}{said[agree]}.")  # fmt: skip
    ranks = report["parts"].get("ranks", {})
    if "speedup_2_ranks" in ranks:
        notes.append(f"2 ranks × 1 thread: {ranks['speedup_2_ranks']:.2f}× the frames/s of "
                     "1 rank × 2 threads.")  # fmt: skip
    if ranks.get("deepmd"):
        notes.append(f"DeePMD-kit, 2 ranks: {ranks['deepmd']}.")
    return "\n".join(lines + ([""] + notes if notes else []))


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="input.json, or a directory holding one and its systems")
    parser.add_argument("--deepmd-env", help="virtual environment holding DeePMD-kit (bin/dp)")
    parser.add_argument("--only", help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--repeat", type=int, help="rounds (default 3; --quick: 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 300; --quick: 4)")
    parser.add_argument("--warmup", type=int, help="steps before timing (default 30; --quick: 2)")
    parser.add_argument("--precision", nargs="+", choices=["float64", "float32"],
                        default=["float64", "float32"])  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="threads per process (default 2)")
    parser.add_argument("--test-frames", type=int,
                        help="test frames per system (default 0: all; --quick: 2)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny step counts, one round")
    parser.add_argument("--json", help="write every figure to this file (- for stdout)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    defaults = {"repeat": 3, "steps": 300, "warmup": 30, "test_frames": 0}
    if args.quick:
        defaults = {"repeat": 1, "steps": 4, "warmup": 2, "test_frames": 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [p.strip() for p in args.only.split(",")] if args.only else list(PARTS)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    if min(args.repeat, args.steps, args.warmup, args.threads) < 1 or args.test_frames < 0:
        parser.error("--repeat, --steps, --warmup and --threads must be at least 1")
    if args.deepmd_env:
        args.deepmd_env = os.path.abspath(args.deepmd_env)
        if not os.access(os.path.join(args.deepmd_env, "bin", "dp"), os.X_OK):
            parser.error(f"--deepmd-env {args.deepmd_env}: no executable bin/dp in it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    input_path = find_input(args.data)
    work = tempfile.mkdtemp(prefix="mdtrain-suite-")
    suite = Suite(args, input_path, work)
    settings = ("parts", "repeat", "steps", "warmup", "precision", "threads", "test_frames",
                "quick", "deepmd_env")  # fmt: skip
    report: dict = {
        "input": input_path,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(args.deepmd_env),
        "settings": {key: getattr(args, key) for key in settings},
        "load_average": {"before": list(os.getloadavg())},
        "parts": {},
        "table": [],
    }
    failed = False
    try:
        for part in args.parts:
            before = list(os.getloadavg())
            try:
                details, rows = getattr(suite, part.replace("-", "_"))()
            except (ChildFailed, RuntimeError) as exc:
                log(f"[{part}] failed: {exc}")
                details, rows = {"error": str(exc).splitlines()[0]}, []
            details["load_average"] = {"before": before, "after": list(os.getloadavg())}
            report["parts"][part] = details
            report["table"] += rows
            failed |= "error" in details or any(
                isinstance(r["mdtrain"], dict) and "error" in r["mdtrain"] for r in rows
            )
    finally:
        report["load_average"]["after"] = list(os.getloadavg())
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(report))
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
            handle.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
