"""Frame and atomic parameter files (fparam.npy, aparam.npy) added to written systems."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from tests.helpers.training import make_project

PARAMS = {"numb_fparam": 2, "numb_aparam": 1}


def add_params(system: str | os.PathLike, numb_fparam: int, numb_aparam: int, seed: int) -> None:
    """Random fparam.npy (nframes, numb_fparam) and aparam.npy (nframes, natoms*numb_aparam)
    in every set of ``system``."""
    rng = np.random.default_rng(seed)
    for set_dir in sorted(glob.glob(os.path.join(system, "set.*"))):
        nframes, values = np.load(os.path.join(set_dir, "coord.npy")).shape
        if numb_fparam:
            fparam = rng.normal([1.0, -2.0, 0.5][:numb_fparam], 0.3, size=(nframes, numb_fparam))
            np.save(os.path.join(set_dir, "fparam.npy"), fparam)
        if numb_aparam:
            natoms = values // 3
            aparam = rng.uniform(0, 1, size=(nframes, natoms * numb_aparam))
            np.save(os.path.join(set_dir, "aparam.npy"), aparam)


def make_param_project(root: str | os.PathLike, **training: object) -> Path:
    """`make_project` with fparam/aparam files and a fitting that takes them."""
    inp = make_project(root, **training)
    for k, system in enumerate(sorted(glob.glob(str(Path(root) / "data" / "*")))):
        add_params(system, PARAMS["numb_fparam"], PARAMS["numb_aparam"], seed=10 + k)
    config = json.loads(inp.read_text())
    config["model"]["fitting_net"].update(PARAMS)
    inp.write_text(json.dumps(config, indent=1))
    return inp
