"""DeePMD-kit's side of the interop tests, run with DeePMD-kit's own Python (never mdtrain's).

It imports neither mdtrain nor torch: DeePMD-kit lives in a virtual environment of its own
(see docs/interop-tests.md). The tests hand it one JSON job file::

    {"convert": [["model.dp", "model.pb"], ...],          # `dp convert-backend IN OUT`
     "evaluate": [{"model": "model.pb", "frames": "in.npz", "out": "out.npz"}, ...],
     "evaluate_tensor": [{"kind": "dipole", "model": "m.dp", "frames": ..., "out": ...}]}

Conversions run first, through DeePMD-kit's own command-line entry point (the code
``dp convert-backend`` runs, in this process: one TensorFlow start-up for the whole job).
A conversion or evaluation that raises is recorded, not fatal: ``JOB.errors.json`` maps
its output path to the exception's last line (DeePMD-kit refusing a setting is a finding).
Each evaluation loads ``model`` with ``deepmd.infer.DeepPot`` (the backend chosen by the
file's suffix: ``.pb`` TensorFlow, ``.dp`` DeePMD's numpy backend) and evaluates the frames
of ``frames``: ``coord`` (nf, N, 3) Å, ``atype`` (N,) indices into the model's type_map,
optional ``box`` (nf, 3, 3) (absent: non-periodic). ``out`` receives ``energy`` (nf,),
``atom_energy`` (nf, N), ``force`` (nf, N, 3) and ``virial`` (nf, 3, 3) as float64, and
the model's ``type_map`` and ``rcut``.

    python deepmd_driver.py JOB.json
"""

from __future__ import annotations

import json
import os
import sys

# quiet TensorFlow, one thread each (the machines running the tests are shared)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
for _name in (
    "OMP_NUM_THREADS",
    "DP_INTRA_OP_PARALLELISM_THREADS",
    "DP_INTER_OP_PARALLELISM_THREADS",
):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402


def convert(src: str, dst: str) -> None:
    from deepmd.main import main

    main(["convert-backend", src, dst])


def evaluate(model: str, frames: str, out: str) -> None:
    from deepmd.infer import DeepPot

    data = np.load(frames)
    coord = np.asarray(data["coord"], dtype=np.float64)
    nf, natoms = coord.shape[:2]
    box = np.asarray(data["box"], dtype=np.float64).reshape(nf, 9) if "box" in data else None
    atype = np.asarray(data["atype"], dtype=np.int64)
    pot = DeepPot(model)
    energy, force, virial, atom_energy, _ = pot.eval(coord.reshape(nf, -1), box, atype, atomic=True)
    np.savez(
        out,
        energy=np.asarray(energy, dtype=np.float64).reshape(nf),
        atom_energy=np.asarray(atom_energy, dtype=np.float64).reshape(nf, natoms),
        force=np.asarray(force, dtype=np.float64).reshape(nf, natoms, 3),
        virial=np.asarray(virial, dtype=np.float64).reshape(nf, 3, 3),
        type_map=np.array(pot.get_type_map()),
        rcut=np.float64(pot.get_rcut()),
    )


def evaluate_tensor(kind: str, model: str, frames: str, out: str) -> None:
    """A dipole or polar model through ``DeepDipole``/``DeepPolar``: ``global`` (nf, 3 or 9)
    and ``atomic`` (nf, N, 3 or 9), atoms in the frames' order, and ``sel_type``."""
    from deepmd.infer.deep_dipole import DeepDipole
    from deepmd.infer.deep_polar import DeepPolar

    data = np.load(frames)
    coord = np.asarray(data["coord"], dtype=np.float64)
    nf, natoms = coord.shape[:2]
    box = np.asarray(data["box"], dtype=np.float64).reshape(nf, 9) if "box" in data else None
    atype = np.asarray(data["atype"], dtype=np.int64)
    dp = (DeepDipole if kind == "dipole" else DeepPolar)(model)
    whole = dp.eval(coord.reshape(nf, -1), box, atype, atomic=False)
    atomic = dp.eval(coord.reshape(nf, -1), box, atype, atomic=True)
    np.savez(
        out,
        **{"global": np.asarray(whole, dtype=np.float64).reshape(nf, -1)},
        atomic=np.asarray(atomic, dtype=np.float64).reshape(nf, natoms, -1),
        sel_type=np.asarray(dp.get_sel_type(), dtype=np.int64),
    )


def main(job_path: str) -> None:
    with open(job_path) as handle:
        job = json.load(handle)
    errors: dict[str, str] = {}

    def attempt(out: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # recorded for the test to judge
            last = (str(exc).strip().splitlines() or [""])[-1]
            errors[out] = f"{type(exc).__name__}: {last}"

    for src, dst in job.get("convert", []):
        attempt(dst, convert, src, dst)
    for item in job.get("evaluate", []):
        if item["model"] in errors:
            errors[item["out"]] = f"no model: {errors[item['model']]}"
            continue
        attempt(item["out"], evaluate, item["model"], item["frames"], item["out"])
    for item in job.get("evaluate_tensor", []):
        args = (item["kind"], item["model"], item["frames"], item["out"])
        attempt(item["out"], evaluate_tensor, *args)
    with open(job_path.removesuffix(".json") + ".errors.json", "w") as handle:
        json.dump(errors, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
