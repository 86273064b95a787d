"""benchmarks/suite.py: the inputs it writes and its step-time parsing (in suite_runs.py), and
quick mdtrain-only runs on generated data (figures are checked for shape and sign only, never
for speed)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.training import make_project, tiny_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py``. benchmarks/ is a folder of scripts that import each other by
    bare name, not a package: it is on ``sys.path`` for the import only."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


suite = benchmark_module("suite")  # the command line: PARTS
runs = benchmark_module("suite_runs")  # inputs and step times: timing_input, step_times, ...
children = benchmark_module("neighbor_stat")  # ChildRun, ChildFailed


def test_timing_input_for_deepmd(tmp_path):
    config = tiny_config(
        stat_file="stat.h5",
        distributed={"backend": "gloo"},
        batch_controller={"grow": True},
        strict_sel=True,
    )
    original = json.dumps(config)
    out = runs.timing_input(config, str(tmp_path), 12, "float32", deepmd=True)
    assert json.dumps(config) == original  # the input itself is untouched
    training = out["training"]
    assert training["training_data"]["systems"] == [
        str(tmp_path / "data/train_a"),
        str(tmp_path / "data/train_b"),
    ]
    assert training["training_data"]["batch_size"] == 1
    assert (training["numb_steps"], training["disp_freq"]) == (12, 1)
    for key in ("validation_data", "stat_file", *runs.MDTRAIN_ONLY):
        assert key not in training
    assert out["model"]["descriptor"]["precision"] == "float32"
    assert out["model"]["fitting_net"]["precision"] == "float32"
    kept = runs.timing_input(config, str(tmp_path), 12, "float64", deepmd=False)["training"]
    assert kept["distributed"] == {"backend": "gloo"} and kept["strict_sel"] is True


def test_step_times_from_arrival_of_log_lines():
    lines = [(0.5, "INFO model: 10 parameters"), (1.0, "INFO step 1/5  rmse 1"),
             (1.5, "INFO step 2/5  rmse 1"), (2.5, "INFO step 3/5  rmse 1"),
             (2.6, "WARNING something"), (3.0, "INFO step 4/5  rmse 1"),
             (4.0, "INFO step 5/5  rmse 1")]  # fmt: skip
    run = children.ChildRun(["mdtrain"], 0, 4.0, 4.0, 100.0, lines)
    assert runs.step_times(run, runs.MDTRAIN_STEP, 2, 3) == [1.0, 0.5, 1.0]
    dp_lines = [(float(k), f"[t] DEEPMD INFO    Batch {k:7d}: total wall time = 0.01 s")
                for k in (1, 2, 3, 5)]  # fmt: skip
    dp_run = children.ChildRun(["dp"], 0, 5.0, 5.0, 100.0, dp_lines)
    assert runs.step_times(dp_run, runs.DP_STEP, 1, 2) == [1.0, 1.0]
    with pytest.raises(children.ChildFailed, match=r"steps \[4\] not found in the log of dp"):
        runs.step_times(dp_run, runs.DP_STEP, 1, 4)
    with pytest.raises(children.ChildFailed, match=r"steps \[6\]"):
        runs.step_times(run, runs.MDTRAIN_STEP, 2, 4)


def run_suite(tmp_path: Path, *args: str) -> tuple[dict, str]:
    project = make_project(tmp_path / "project").parent
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    out = tmp_path / "suite.json"
    command = [sys.executable, str(BENCHMARKS / "suite.py"), str(project), "--quick",
               "--threads", "1", "--json", str(out), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
    return json.loads(out.read_text()), done.stdout


def check_rows(report: dict, expected: set[str]) -> None:
    rows = {r["what"]: r for r in report["table"]}
    assert set(rows) == expected
    for r in rows.values():
        figure = r["mdtrain"]
        if figure is None and r["what"].endswith("evaluation"):
            continue  # start-up subtracted: None when the one-frame run happened to be slower
        assert figure["median"] > 0 and all(v > 0 for v in figure["values"]), r
        assert r["deepmd"] is None and r["ratio"] is None


def test_quick_neighbor_stat_and_train(tmp_path):
    report, table = run_suite(tmp_path, "--only", "neighbor-stat,train", "--precision", "float32")
    assert report["settings"]["parts"] == ["neighbor-stat", "train"]
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert len(report["load_average"]["before"]) == len(report["load_average"]["after"]) == 3
    check_rows(report, {"neighbour statistics, whole process",
                        "training step, float32, batch 1 (median)",
                        "training process, float32: peak RSS"})  # fmt: skip
    (nstat,) = report["parts"]["neighbor-stat"]["results"]["mdtrain"]
    assert 0 < nstat["min_nbor_dist"] < 4.0 and min(nstat["max_nbor_size"]) > 0
    (step,) = report["parts"]["train"]["results"]["mdtrain float32"]
    assert step["step_median_s"] > 0 and step["step_mean_s"] > 0
    assert "| neighbour statistics, whole process (s) |" in table


@pytest.mark.slow
def test_quick_all_parts(tmp_path):
    report, _ = run_suite(tmp_path)
    assert report["settings"]["parts"] == list(suite.PARTS)
    check_rows(report, {
        "neighbour statistics, whole process",
        *(f"training step, {p}, batch 1 (median)" for p in ("float64", "float32")),
        *(f"training process, {p}: peak RSS" for p in ("float64", "float32")),
        *(f"test ({kind} model), {what}" for kind in ("checkpoint", "frozen")
          for what in ("whole process", "evaluation", "peak RSS")),
        "training, 1 rank × 2 threads, float64",
        "training, 2 ranks × 1 thread (Gloo), float64",
    })  # fmt: skip
    assert report["parts"]["test"]["frames"] == 2
    assert report["parts"]["ranks"]["speedup_2_ranks"] > 0


def test_train_step_times_a_committee_beside_the_single_model(tmp_path):
    """benchmarks/train_step.py --ensemble 1 2 --paired: both sizes timed in one process."""
    inp = make_project(tmp_path, numb_steps=1)
    out = tmp_path / "paired.json"
    cmd = [sys.executable, str(BENCHMARKS / "train_step.py"), str(inp), "--precision", "float64"]
    cmd += ["--threads", "1", "--steps", "2", "--warmup", "1", "--ensemble", "1", "2"]
    cmd += ["--paired", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert set(result["sizes"]) == {"1", "2"}
    assert result["sizes"]["1"]["paired_wall_ratio"] == 1.0
    assert result["sizes"]["2"]["wall_s_per_step"] > 0
    assert "committee of 2" in done.stdout


def test_step_outside_times_the_update_and_the_loss(tmp_path):
    """benchmarks/step_outside.py on a generated project: one line with every part; whole
    steps paired."""
    inp = make_project(tmp_path, numb_steps=1)
    cmd = [sys.executable, str(BENCHMARKS / "step_outside.py"), str(inp), "--precision"]
    cmd += ["float64", "--calls", "2", "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "float64, 1 thread(s)" in done.stdout
    assert "update" in done.stdout and "loss forward+backward" in done.stdout
    assert "batch" in done.stdout and "pair vectors" in done.stdout and "zero_grad" in done.stdout
    done = subprocess.run([*cmd, "--paired-steps", "2"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 pairs" in done.stdout and "median of the pairs' differences" in done.stdout
    done = subprocess.run([*cmd, "--paired-vectors", "2"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    if "no compiled pair vectors" not in done.stderr:  # a backend without the kernels
        assert done.returncode == 0, done.stderr[-2000:]
        assert "2 pairs" in done.stdout


def test_row_grad_times_the_row_gradients():
    """benchmarks/row_grad.py: the pieces the force node gets, a checksum, one line per part."""
    cmd = [sys.executable, str(BENCHMARKS / "row_grad.py"), "--precision", "float32"]
    cmd += ["--calls", "1", "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, *parts = done.stdout.splitlines()
    assert "pieces [(192, 138, 4)], checksum" in first
    assert float(first.rsplit(" ", 1)[1]) > 0
    assert [p.split()[0] for p in parts] == ["forward", "forward+backward"]


def test_embed_kernels_times_the_recorded_calls():
    """benchmarks/embed_kernels.py: both calls of a step recorded, one line of positive times."""
    cmd = [sys.executable, str(BENCHMARKS / "embed_kernels.py"), "--precision", "float32"]
    done = subprocess.run(cmd + ["--reps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip()
    assert line.startswith("float32, 1 thread(s), 2 calls per step: forward "), line
    forward = float(line.split("forward ")[1].split(" ms")[0])
    backward = float(line.split("backward ")[1].split(" ms")[0])
    assert forward > 0 and backward > 0, line


def test_embed_contract_pairs_the_two_trees_steps():
    """benchmarks/embed_contract.py against this tree itself: a line per side, one of ratios."""
    tree = str(BENCHMARKS.parent)
    cmd = [sys.executable, str(BENCHMARKS / "embed_contract.py"), "--against", tree]
    done = subprocess.run(cmd + ["--steps", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    other, this, ratios = done.stdout.strip().splitlines()
    assert other.startswith("other: wall ") and this.startswith("this: wall "), done.stdout
    assert float(ratios.rsplit("cpu ", 1)[1]) > 0, ratios


def test_descriptor_speed_input_and_slopes(tmp_path):
    """descriptor_speed.py: the example's copy (absolute systems, the run's step counts, the
    rest kept) and the wall/CPU slopes between two display lines of a child process."""
    speed = benchmark_module("descriptor_speed")
    example = tmp_path / "ex" / "input.json"
    example.parent.mkdir()
    config = tiny_config(validation_data={"systems": ["data/val"], "batch_size": 1})
    example.write_text(json.dumps(config))
    out = speed.example_input(str(example), 20, 10)
    training = out["training"]
    assert training["training_data"]["systems"][0] == str(tmp_path / "ex/data/train_a")
    assert training["validation_data"]["systems"] == [str(tmp_path / "ex/data/val")]
    assert (training["numb_steps"], training["disp_freq"], training["save_freq"]) == (20, 10, 20)
    assert out["model"] == config["model"]

    script = "import time\nfor k in (2, 4):\n    time.sleep(0.2)\n    print(f'INFO step {k}/4', flush=True)\n"  # fmt: skip
    run = speed.run_marked([sys.executable, "-c", script], dict(os.environ), str(tmp_path),
                           speed.MARKS["mdtrain"])  # fmt: skip
    assert sorted(run["marks"]) == [2, 4]
    (w2, c2), (w4, c4) = run["marks"][2], run["marks"][4]
    assert 0.15 < w4 - w2 < 30.0 and 0.0 <= c4 - c2 < 0.15  # asleep: wall time, little CPU
    assert speed.cpu_seconds(os.getpid()) > 0.0


@pytest.mark.parametrize(
    "descriptor",
    [
        {"type": "se_atten", "sel": 24, "rcut": 4.0, "rcut_smth": 0.5, "neuron": [4, 8],
         "axis_neuron": 4, "attn": 8, "attn_layer": 1, "seed": 1},
        {"type": "hybrid", "list": [
            {"type": "se_e2_a", "sel": [8, 16], "rcut": 3.0, "rcut_smth": 0.5,
             "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
            {"type": "se_e2_r", "sel": [10, 20], "rcut": 4.0, "rcut_smth": 0.5,
             "neuron": [4, 8], "seed": 1},
        ]},
    ],
    ids=["se_atten", "hybrid"],
)  # fmt: skip
def test_train_step_times_type_mixed_and_hybrid_descriptors(tmp_path, descriptor):
    """benchmarks/train_step.py fills its neighbour-list cache with the trainer's own lists: an
    integer ``sel`` (type-mixed) and a hybrid's members no longer break it."""
    inp = make_project(tmp_path, numb_steps=1)
    config = json.loads(inp.read_text())
    config["model"]["descriptor"] = descriptor
    inp.write_text(json.dumps(config))
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(BENCHMARKS / "train_step.py"), str(inp), "--precision", "float64"]
    cmd += ["--threads", "1", "--steps", "1", "--warmup", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["wall_s_per_step"] > 0 and result["batch_uncached_s"] > 0
    assert sum(result["sel"]) >= 24  # the largest list (the hybrid's union)
