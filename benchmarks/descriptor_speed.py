"""Training speed per descriptor, side by side with DeePMD-kit, on DeePMD-kit's example inputs.

    python benchmarks/descriptor_speed.py --examples DEEPMD_SRC/examples/water \
        --deepmd-env DPKIT_PT_VENV [--only se_e2_r,se_atten] [--steps 60] [--disp 10] \
        [--rounds 3] [--threads 1] [--json FILE]

For each example input (``EXAMPLES`` below: one per descriptor, the paths inside DeePMD-kit's
``examples/water``), each round runs ``mdtrain train input.json`` and then ``dp --pt train
input.json`` (the order swapped every other round, so that both see the same load), each a
fresh process with ``OMP_NUM_THREADS`` and DeePMD-kit's ``DP_INTRA_OP_PARALLELISM_THREADS``
set to ``--threads``. Both get the same copy of the example, written to a fresh temporary
directory: the system paths made absolute, ``numb_steps`` ``--steps``, ``disp_freq``
``--disp``, ``save_freq`` ``--steps`` (one checkpoint, at the end), everything else as the
example has it (its validation data, batch size, precision, stat_file inside the directory).

The figure is the per-step slope of the whole training process: the time between the arrival
of the display line of step ``--disp`` and that of step ``--steps`` (each tool prints one per
display, ``INFO step K/N`` and ``Batch K: total wall time``), divided by ``steps - disp``. It
includes everything the process does per step (batches, neighbour lists, the step, the
validation of every display, the log) and leaves out the start-up, the statistics and the
first ``--disp`` steps. The CPU time per step is taken the same way, from the CPU time
of the process and its live descendants (DeePMD-kit reads data in worker processes) when
each line arrives: on a machine shared with other work it moves much less than the wall
time. The table gives the median over rounds and the range of the rounds,
and the ratio DeePMD-kit/mdtrain (median of the rounds' ratios: above 1 favours mdtrain).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from neighbor_stat import ChildFailed, mdtrain_command
from suite_runs import log, machine_info, thread_env

EXAMPLES = {
    "se_e2_r": "se_e2_r/input.json",
    "se_e3": "se_e3/input.json",
    "se_e3_tebd": "se_e3_tebd/input_torch.json",
    "hybrid": "hybrid/input.json",
    "se_atten": "se_atten/input.json",
    "se_atten (torch)": "se_atten/input_torch.json",
    "se_atten_compressible": "se_atten_compressible/input.json",
    "se_atten_dpa1_compat": "se_atten_dpa1_compat/input.json",
}
MARKS = {
    "mdtrain": re.compile(r"INFO step (\d+)/\d+"),
    "deepmd": re.compile(r"Batch\s+(\d+): total wall time"),
}


def example_input(path: str, steps: int, disp: int) -> dict:
    """The example at ``path`` with absolute systems and the run's step counts."""
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    base = os.path.dirname(os.path.abspath(path))
    config = copy.deepcopy(config)
    training = config["training"]
    for key in ("training_data", "validation_data"):
        data = training.get(key)
        if not data:
            continue
        systems = data["systems"]
        systems = [systems] if isinstance(systems, str) else systems
        data["systems"] = [os.path.normpath(os.path.join(base, s)) for s in systems]
    training.update(numb_steps=steps, disp_freq=disp, save_freq=steps)
    return config


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds so far of process ``root``, its threads and every live
    descendant (DeePMD-kit reads its data in worker processes), plus the children it has
    reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                    stats[int(entry)] = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            fields = stats[pid]
            total += int(fields[11]) + int(fields[12])
            if pid == root:
                total += int(fields[13]) + int(fields[14])
        todo += children.get(pid, [])
    return total / tick


def run_marked(command: list[str], env: dict, cwd: str, pattern: re.Pattern) -> dict:
    """Run ``command``; for every line that ``pattern`` marks with a step number, the wall
    time since the start and the process's CPU time when the line arrived."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=cwd)  # fmt: skip
    marks: dict[int, tuple[float, float]] = {}
    tail: list[str] = []
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        found = pattern.search(line := raw.decode(errors="replace").rstrip("\n"))
        if found:
            marks.setdefault(
                int(found.group(1)), (time.perf_counter() - start, cpu_seconds(proc.pid))
            )
        tail = [*tail[-14:], line]
    if proc.wait() != 0:
        raise ChildFailed(f"exit code {proc.returncode}: {' '.join(command)}\n" + "\n".join(tail))
    return {"marks": marks, "wall_s": time.perf_counter() - start, "tail": tail}


def one_run(tool: str, command: list[str], config: dict, args) -> dict:
    """One training process: its wall and CPU seconds per step between the displays of
    steps ``--disp`` and ``--steps``."""
    with tempfile.TemporaryDirectory(prefix=f"speed-{tool}-") as work:
        with open(os.path.join(work, "input.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=1)
        run = run_marked([*command, "input.json"], thread_env(args.threads), work, MARKS[tool])
    marks, first, last = run["marks"], args.disp, args.steps
    if first not in marks or last not in marks:
        raise ChildFailed(
            f"display of step {first} or {last} not in the log:\n" + "\n".join(run["tail"])
        )
    n = last - first
    return {"s_per_step": (marks[last][0] - marks[first][0]) / n,
            "cpu_s_per_step": (marks[last][1] - marks[first][1]) / n, "wall_s": run["wall_s"]}  # fmt: skip


def measure(name: str, args) -> dict:
    """Alternating rounds of both tools on one example; {tool: [round results]}."""
    config = example_input(os.path.join(args.examples, EXAMPLES[name]), args.steps, args.disp)
    commands = {"mdtrain": [*mdtrain_command(), "train"]}
    if args.deepmd_env:
        commands["deepmd"] = [os.path.join(args.deepmd_env, "bin", "dp"), "--pt", "train"]
    results: dict = {tool: [] for tool in commands}
    for r in range(args.rounds):
        order = list(commands) if r % 2 == 0 else list(reversed(commands))
        for tool in order:
            load = os.getloadavg()[0]
            try:
                res = one_run(tool, commands[tool], config, args)
            except ChildFailed as exc:
                log(f"[{name}] {tool} failed: {exc}")
                results[tool].append({"error": str(exc).splitlines()[0]})
                continue
            res["load_before"], res["load_after"] = load, os.getloadavg()[0]
            results[tool].append(res)
            log(f"[{name}] round {r + 1} {tool}: {res['s_per_step']:.4f} s/step "
                f"(CPU {res['cpu_s_per_step']:.4f}), "
                f"load {load:.1f}-{res['load_after']:.1f}")  # fmt: skip
    return results


def cell(values: list[float]) -> str:
    if not values:
        return "failed"
    med = statistics.median(values)
    return f"{med:.4g} ({min(values):.4g}–{max(values):.4g})"


def figures(res: dict, key: str) -> tuple[str, str, str]:
    """Cells of mdtrain, DeePMD-kit and their ratio (per round, DeePMD-kit over mdtrain)."""
    md = [r[key] for r in res["mdtrain"] if key in r]
    dp = [r[key] for r in res.get("deepmd", []) if key in r]
    ratios = [b[key] / a[key] for a, b in zip(res["mdtrain"], res.get("deepmd", []))
              if key in a and key in b]  # fmt: skip
    return cell(md), cell(dp) if dp else "—", cell(ratios) if ratios else "—"


def table(all_results: dict) -> str:
    lines = [
        "| example | mdtrain s/step | DeePMD-kit s/step | DeePMD-kit / mdtrain "
        "| CPU s/step mdtrain | CPU s/step DeePMD-kit | CPU ratio | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, res in all_results.items():
        loads = [r[k] for t in res.values() for r in t for k in ("load_before", "load_after")
                 if k in r]  # fmt: skip
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"
        cells = [*figures(res, "s_per_step"), *figures(res, "cpu_s_per_step"), load]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", required=True, help="DeePMD-kit's examples/water")
    parser.add_argument("--deepmd-env", help="a virtual environment with DeePMD-kit 3.2")
    parser.add_argument("--only", help="comma-separated names of EXAMPLES (default: all)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--disp", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write every round's figures to this file")
    args = parser.parse_args(argv)
    if not 0 < args.disp < args.steps or args.steps % args.disp:
        parser.error("--disp must divide --steps and be smaller")
    names = args.only.split(",") if args.only else list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example {unknown[0]!r}; known: {', '.join(EXAMPLES)}")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {name: measure(name, args) for name in names}
    info = machine_info(args.deepmd_env)
    print(f"{started}, {info['cpu']}, {args.threads} thread(s), mdtrain "
          f"{info['mdtrain_commit']}{' (modified)' if info['mdtrain_modified'] else ''}, "
          f"DeePMD-kit {info.get('deepmd_kit')}, steps {args.disp}→{args.steps}, "
          f"{args.rounds} rounds; median (range of the rounds)\n")  # fmt: skip
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "machine": info, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
