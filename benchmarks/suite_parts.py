"""The four parts of the suite (``neighbor-stat``, ``train``, ``test``, ``ranks``): what each
runs for mdtrain and for DeePMD-kit, and the table rows it reports. See ``suite.py`` for what
is measured and how.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

from neighbor_stat import ChildFailed, mdtrain_command, mdtrain_neighbor_stat, run_child
from suite_runs import (
    DP_STEP,
    MDTRAIN_STEP,
    Runner,
    alternate,
    costs,
    row,
    step_times,
    thread_env,
    timing_input,
    write_input,
)
from train_step import run_measure

NO_DP_RANKS = "n/a: DeePMD-kit's torchrun training asks for NCCL, which a CPU-only torch lacks"
FROM_TRAIN_STEP = {"step_median_s": "wall_s_per_step", "step_mean_s": "wall_mean_s",
                   "cpu_s_per_step": "cpu_s_per_step", "peak_rss_mib": "peak_rss_mb"}  # fmt: skip


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
