"""DeePMD-kit's own example inputs through mdtrain, and mdtrain's figures against DeePMD-kit's.

Two parts, both run by default:

1. Tally: ``mdtrain check`` on every training input under ``examples/`` of a DeePMD-kit
   checkout, run from the example's own folder as a user would (the input unchanged). A
   training input is a ``.json`` file holding a JSON object with a ``training`` section
   (i-PI's ``water/ipi/water.json`` and other non-inputs are left out). Prints accepted /
   refused and the first line of each refusal.
2. Parity: for a list of examples (default: the 17 of issues 22 and 23), the input copied to a
   scratch folder with its relative paths made absolute and a short run (``--steps``), then
   ``mdtrain check`` → ``train`` → ``freeze -o model.dp`` → ``dp convert-backend model.dp
   model.pth`` → ``mdtrain test -m model.dp`` and ``dp --pt test -m model.pth`` on the same
   systems (the validation systems, else the training ones), one system per call so that
   both programs' figures cover the same frames. Each RMSE both print is compared; a float64
   model must agree to 1e-6 relative (DeePMD-kit prints 7 significant digits, mdtrain's are
   read at full precision from ``--json``), a float32 one to 1e-4 (the two programs sum in
   different orders, float32 carries about 7 digits and an RMSE of a small error amplifies
   the rounding of the values it is the difference of).

    python benchmarks/deepmd_examples.py --deepmd-src ~/deepmd-kit --dp ~/dp-pt/bin/dp \\
        --steps 2 -n 2 --json parity.json

Nothing here depends on where DeePMD-kit lives: the checkout and its ``dp`` are arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_EXAMPLES = (
    "water/se_e2_r/input.json",
    "water/se_e3/input.json",
    "water/se_e3_tebd/input_torch.json",
    "water/hybrid/input.json",
    "water/se_atten/input.json",
    "water/se_atten/input_torch.json",
    "water/se_atten_compressible/input.json",
    "water/se_atten_dpa1_compat/input.json",
    "nopbc/mixed/input.json",
    "fparam/train/input.json",
    "fparam/train/input_aparam.json",
    "water/zbl/input.json",
    "water/linear/input_pt.json",
    "water/d3/input_pt.json",
    "water_tensor/dipole/dipole_input_torch.json",
    "water_tensor/polar/polar_input_torch.json",
    "dos/train/input_torch.json",
    "property/train/input_torch.json",
)
TOL_FLOAT64 = 1e-6
TOL_FLOAT32 = 1e-4
# DeePMD-kit's dp test lines, e.g. "Energy RMSE/Natoms : 1.234567e-03 eV"
DP_RMSE = re.compile(
    r"(Energy|Force|Virial|Dipole|Polarizability|Atomic DOS|DOS|Atomic PROPERTY|PROPERTY)"
    r"\s+RMSE(/Natoms|/sqrtN|/N)?\s*:\s*(\S+)"
)
DP_NAMES = {
    ("Energy", ""): "energy",
    ("Energy", "/Natoms"): "energy/atom",
    ("Force", ""): "force",
    ("Virial", ""): "virial",
    ("Virial", "/Natoms"): "virial/atom",
    ("Dipole", ""): "dipole",
    ("Polarizability", ""): "polarizability",
    ("DOS", ""): "dos",
    ("DOS", "/Natoms"): "dos/atom",
    ("Atomic DOS", ""): "atom_dos",
    ("PROPERTY", ""): "property",
    ("Atomic PROPERTY", ""): "atom_property",
}
# mdtrain test --json summary keys → the names above
MD_KEYS = {
    "energy_rmse": "energy",
    "energy_rmse_per_atom": "energy/atom",
    "force_rmse": "force",
    "virial_rmse": "virial",
    "virial_rmse_per_atom": "virial/atom",
    "dipole_rmse": "dipole",
    "atomic_dipole_rmse": "atomic_dipole",
    "polarizability_rmse": "polarizability",
    "atomic_polarizability_rmse": "atomic_polarizability",
    "dos_rmse": "dos",
    "dos_rmse_per_atom": "dos/atom",
    "atom_dos_rmse": "atom_dos",
    "property_rmse": "property",
    "atom_property_rmse": "atom_property",
}
TENSOR_LABELS = ("dipole", "polarizability")


# ---------------------------------------------------------------- parsing and comparing


def parse_dp_test(text: str, atomic: bool = False) -> dict[str, float]:
    """The RMSEs of the first system block of ``dp test``'s log (the weighted average block,
    which follows, is ignored). ``atomic``: a tensor test run with ``-a``, whose "Dipole RMSE"
    is the atomic dipole's."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if "weighted average" in line:
            break
        m = DP_RMSE.search(line)
        if not m or (m.group(1), m.group(2) or "") not in DP_NAMES:
            continue
        name = DP_NAMES[(m.group(1), m.group(2) or "")]
        if atomic and name in TENSOR_LABELS:
            name = "atomic_" + name
        out.setdefault(name, float(m.group(3)))
    return out


def parse_mdtrain_json(data: dict) -> dict[str, float]:
    """The pooled RMSEs of ``mdtrain test --json`` (its ``total``)."""
    total = data.get("total", {})
    return {name: float(total[key]) for key, name in MD_KEYS.items() if key in total}


def compare(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
    """Relative difference per quantity both report: |a - b| / max(|a|, |b|) (0 when both 0)."""
    diffs = {}
    for name in ours.keys() & theirs.keys():
        a, b = ours[name], theirs[name]
        scale = max(abs(a), abs(b))
        diffs[name] = 0.0 if scale == 0 else abs(a - b) / scale
    return diffs


@dataclass
class Row:
    """One (example, test system) comparison."""

    example: str
    system: str = ""
    precision: str = "float64"
    mdtrain: dict[str, float] = field(default_factory=dict)
    deepmd: dict[str, float] = field(default_factory=dict)
    max_rel: float | None = None
    status: str = "fail"
    note: str = ""
    wall_s: float = 0.0

    def judge(self) -> None:
        """Largest relative difference and pass/fail by the precision's bound."""
        diffs = compare(self.mdtrain, self.deepmd)
        if not diffs:
            self.status = "fail"
            self.note = self.note or "no RMSE reported by both"
            return
        self.max_rel = max(diffs.values())
        tol = TOL_FLOAT32 if self.precision == "float32" else TOL_FLOAT64
        self.status = "pass" if self.max_rel <= tol else "fail"


def format_table(rows: list[Row]) -> str:
    """Plain text: one line per (example, system, quantity), the verdict on its first line."""
    head = f"{'example':<44}{'system':<22}{'quantity':<22}{'mdtrain':>14}{'dp --pt':>14}"
    head += f"{'max rel':>10}  {'result':<6}{'wall s':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        names = sorted(r.mdtrain.keys() | r.deepmd.keys()) or ["-"]
        for k, name in enumerate(names):
            a, b = r.mdtrain.get(name), r.deepmd.get(name)
            first = k == 0
            lines.append(
                f"{(r.example if first else ''):<44}{(r.system if first else ''):<22}{name:<22}"
                f"{_num(a):>14}{_num(b):>14}"
                f"{(_num(r.max_rel, '.1e') if first else ''):>10}  "
                f"{(r.status if first else ''):<6}{(f'{r.wall_s:.0f}' if first else ''):>8}"
            )
        if r.note:
            lines.append(f"{'':<44}note: {r.note}")
    return "\n".join(lines)


def _num(x: float | None, fmt: str = ".6e") -> str:
    return "-" if x is None else format(x, fmt)


# ---------------------------------------------------------------- the example inputs


def is_training_input(path: Path) -> bool:
    """A JSON object with a ``training`` section (DeePMD-kit's inputs all have one)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "training" in data


def training_inputs(examples: Path) -> list[Path]:
    return sorted(p for p in examples.rglob("*.json") if is_training_input(p))


def run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """A command's exit status and its stdout+stderr (timeouts as status 124)."""
    try:
        p = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return 124, out if isinstance(out, str) else out.decode(errors="replace")
    return p.returncode, p.stdout + p.stderr


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def tally(examples: Path, timeout: float) -> list[tuple[str, bool, str]]:
    """(input, accepted, first line of the refusal) for every training input."""
    out = []
    for path in training_inputs(examples):
        rc, text = run([sys.executable, "-m", "mdtrain", "check", path.name], path.parent, timeout)
        out.append((str(path.relative_to(examples)), rc == 0, "" if rc == 0 else first_line(text)))
        print(f"  {'accepted' if rc == 0 else 'REFUSED '}  {out[-1][0]}  {out[-1][2]}", flush=True)
    return out


def absolutise(value, folder: Path):
    """Every relative string naming an existing file or folder of ``folder``, made absolute."""
    if isinstance(value, dict):
        return {k: v if k == "type_map" else absolutise(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [absolutise(v, folder) for v in value]
    if isinstance(value, str) and value and not os.path.isabs(value):
        target = folder / value
        if target.exists():
            return str(target.resolve())
    return value


def short_run(config: dict, steps: int) -> dict:
    """The input with ``steps`` training steps, its display and checkpoint within them."""
    t = config["training"]
    for key in ("stop_batch", "num_epoch", "num_epoch_dict"):
        t.pop(key, None)
    t["numb_steps"] = steps
    t["disp_freq"] = min(int(t.get("disp_freq", steps)), steps)
    t["save_freq"] = steps
    return config


def systems_of(entry) -> list[Path]:
    """DeePMD-kit systems named by a ``systems`` entry (a folder holding several expanded)."""
    paths = [entry] if isinstance(entry, str) else list(entry)
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "type.raw").exists():
            found.append(p)
        else:
            found += sorted(q.parent for q in p.rglob("type.raw"))
    return found


def model_precision(config: dict) -> str:
    """float32 if any network of the model is float32 (members of a linear model too)."""
    text = json.dumps(config.get("model", {}))
    return "float32" if re.search(r'"precision":\s*"float32"', text) else "float64"


def dp_atomic(system: Path) -> bool:
    """``dp test -a`` for a system with only atomic tensor labels (dp test needs the label
    it is asked for)."""
    names = {p.name for p in system.glob("set.*/*.npy")}
    return any(f"atomic_{t}.npy" in names and f"{t}.npy" not in names for t in TENSOR_LABELS)


def needs_global(system: Path) -> bool:
    """A system with atomic DOS/property labels only: ``dp test`` requires the global label
    (``dos.npy``, the property's file) even with ``-a``, so it cannot test it."""
    names = {p.name for p in system.glob("set.*/*.npy")}
    return (
        "atom_dos.npy" in names
        and "dos.npy" not in names
        or any(
            n.startswith("atom_") and n[5:] not in names and n[5:-4] not in ("dos", "ener", "pref")
            for n in names
            if n.startswith("atom_") and n != "atom_dos.npy"
        )
    )


def parity(example: str, args, examples: Path) -> list[Row]:
    """Check, train, freeze, convert and test one example; a row per test system."""
    src = examples / example
    slug = example.replace("/", "__").removesuffix(".json")
    work = Path(args.workdir).resolve() / slug
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = short_run(absolutise(json.loads(src.read_text()), src.parent), args.steps)
    (work / "input.json").write_text(json.dumps(config, indent=1))
    start = time.perf_counter()
    mdtrain = [sys.executable, "-m", "mdtrain"]
    steps = [
        ("check", [*mdtrain, "check", "input.json"]),
        ("train", [*mdtrain, "train", "input.json", "-o", "out"]),
        ("freeze", [*mdtrain, "freeze", "-c", "out/model.ckpt.pt", "-o", "model.dp"]),
        ("convert", [args.dp, "convert-backend", "model.dp", "model.pth"]),
    ]
    for name, cmd in steps:
        rc, text = run(cmd, work, args.timeout)
        (work / f"{name}.log").write_text(text)
        if rc != 0:
            tail = [s for s in text.splitlines() if s.strip()][-1:] or [""]
            note = f"{name} failed (rc {rc}): {tail[0].strip()[:200]}"
            return [Row(example, note=note, wall_s=time.perf_counter() - start)]
    section = config["training"].get("validation_data") or config["training"]["training_data"]
    rows = []
    for system in systems_of(section["systems"]):
        row = Row(example, system=system.name, precision=model_precision(config))
        rows.append(row)
        n = str(args.numb_test)
        tag = f"{slug}.{system.name}"
        rc, text = run(
            [*mdtrain, "test", "-m", "model.dp", "-s", str(system), "-n", n,
             "--json", f"{tag}.json"],
            work, args.timeout,
        )  # fmt: skip
        (work / f"mdtrain_test.{system.name}.log").write_text(text)
        if rc == 0:
            row.mdtrain = parse_mdtrain_json(json.loads((work / f"{tag}.json").read_text()))
        else:
            row.note = f"mdtrain test failed: {first_line(text)[:200]}"
        if needs_global(system):
            row.status, row.note = "skip", "dp test needs the global label (dos.npy/property)"
            continue
        atomic = dp_atomic(system)
        cmd = [args.dp, "--pt", "test", "-m", "model.pth", "-s", str(system), "-n", n]
        rc, text = run(cmd + (["-a"] if atomic else []), work, args.timeout)
        (work / f"dp_test.{system.name}.log").write_text(text)
        if rc == 0:
            row.deepmd = parse_dp_test(text, atomic)
        else:
            tail = [s for s in text.splitlines() if s.strip()][-1:] or [""]
            row.note += f" dp test failed: {tail[0].strip()[:200]}"
        row.judge()
    wall = time.perf_counter() - start
    for row in rows:
        row.wall_s = wall
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepmd-src", required=True, help="a DeePMD-kit checkout (its examples/)")
    ap.add_argument("--dp", help="DeePMD-kit's dp with the PyTorch backend (for the parity)")
    ap.add_argument("--examples", nargs="*", default=list(DEFAULT_EXAMPLES),
                    help="inputs under examples/ to compare (default: issues 22 and 23's)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=2, help="training steps per example")
    ap.add_argument("-n", "--numb-test", type=int, default=2, help="frames per test system")
    ap.add_argument("--workdir", default="deepmd_examples_runs", help="scratch folder")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--no-tally", action="store_true", help="skip the mdtrain check tally")
    ap.add_argument("--no-parity", action="store_true", help="only the tally")
    ap.add_argument("--json", help="write the tally and the rows to this file")
    args = ap.parse_args(argv)
    examples = Path(args.deepmd_src) / "examples"
    if not examples.is_dir():
        ap.error(f"{examples}: not a folder")
    if not args.no_parity and not args.dp:
        ap.error("--dp is needed for the parity part (or give --no-parity)")
    begin = time.perf_counter()
    report: dict = {}
    if not args.no_tally:
        print(f"mdtrain check on the training inputs of {examples}:", flush=True)
        t = tally(examples, args.timeout)
        ok = sum(a for _, a, _ in t)
        print(f"tally: {ok} of {len(t)} accepted\n", flush=True)
        report["tally"] = [{"input": i, "accepted": a, "refusal": r} for i, a, r in t]
    rows: list[Row] = []
    if not args.no_parity:
        for example in args.examples:
            print(f"parity: {example} ...", flush=True)
            rows += parity(example, args, examples)
            print(format_table([r for r in rows if r.example == example]), flush=True)
        print("\n" + format_table(rows))
        passed = sum(r.status == "pass" for r in rows)
        rows_judged = [r for r in rows if r.status != "skip"]
        print(f"\n{passed} of {len(rows)} (example, system) comparisons pass "
              f"({len(rows) - len(rows_judged)} skipped); "
              f"total wall {time.perf_counter() - begin:.0f} s")  # fmt: skip
        report["rows"] = [asdict(r) for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
