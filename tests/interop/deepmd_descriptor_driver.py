"""DeePMD-kit's side of the descriptor interop test, run with DeePMD-kit's own Python.

It imports neither mdtrain nor torch. One JSON job file::

    {"models": "models.npz", "frames": "frames.npz", "out": "out.npz", "backend": "numpy"}

``models.npz`` holds serialised descriptors (``tests/helpers/serialized_npz.py``; names in
its ``names`` entry); ``frames.npz`` groups of frames (``<group>/coord`` (nf, N, 3),
``<group>/atype`` (N,), optional ``<group>/box`` (nf, 3, 3); group names in ``groups``).
Each model is read by DeePMD-kit's own ``deserialize`` of its type (``backend`` "numpy":
``deepmd.dpmodel``; "pt": ``deepmd.pt``, the backend ``dp --pt`` runs, which needs torch)
and evaluated on every group with that backend's type-mixed neighbour list; ``out.npz`` receives
``<name>/<group>`` (the descriptor) and ``<name>/again`` (DeePMD-kit's re-serialisation,
as ``serialized_npz`` entries), and ``defaults/<type>`` the argcheck defaults (JSON).

    python deepmd_descriptor_driver.py JOB.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from dargs import Argument  # noqa: E402
from deepmd.utils import argcheck  # noqa: E402

from tests.helpers.serialized_npz import entries, read  # noqa: E402

NAMES = {"dpa1": "DescrptDPA1", "se_atten_v2": "DescrptSeAttenV2", "se_e3_tebd": "DescrptSeTTebd"}
ARGS = {
    "se_atten": argcheck.descrpt_se_atten_args,
    "se_atten_v2": argcheck.descrpt_se_atten_v2_args,
    "se_e3_tebd": argcheck.descrpt_se_e3_tebd_args,
}


def defaults(kind: str) -> dict:
    """argcheck's filled section for a section with only ``sel``."""
    arg = Argument("descriptor", dict, sub_fields=ARGS[kind]())
    return arg.normalize_value({"sel": 10}, trim_pattern="_*")


def backend(name: str):
    """``(classes by serialised type, evaluate(desc, coord, atype, box) -> D)``."""
    if name == "pt":
        import torch
        from deepmd.pt.model import descriptor as module
        from deepmd.pt.utils.nlist import extend_input_and_build_neighbor_list as lists

        def evaluate(desc, coord, atype, box):
            args = [torch.as_tensor(a) if a is not None else None for a in (coord, atype, box)]
            ext, ext_type, mapping, nlist = lists(
                args[0], args[1], desc.get_rcut(), desc.get_sel(), mixed_types=True, box=args[2]
            )
            return desc(ext, ext_type, nlist, mapping)[0].detach().numpy()

    else:
        from deepmd.dpmodel import descriptor as module
        from deepmd.dpmodel.utils.nlist import extend_input_and_build_neighbor_list as lists

        def evaluate(desc, coord, atype, box):
            ext, ext_type, mapping, nlist = lists(
                coord, atype, desc.get_rcut(), desc.get_sel(), mixed_types=True, box=box
            )
            return desc.call(ext.reshape(coord.shape[0], -1), ext_type, nlist, mapping)[0]

    return {k: getattr(module, v) for k, v in NAMES.items()}, evaluate


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    models, frames = np.load(job["models"]), np.load(job["frames"])
    classes, evaluate = backend(job.get("backend", "numpy"))
    out: dict[str, np.ndarray] = {}
    for kind in ARGS:
        out[f"defaults/{kind}"] = np.array(json.dumps(defaults(kind)))
    for name in json.loads(str(models["names"])):
        data = read(models, name)
        desc = classes[data["type"]].deserialize(data)
        out.update(entries(f"{name}/again", desc.serialize()))
        for group in json.loads(str(frames["groups"])):
            coord = frames[f"{group}/coord"]
            nf = coord.shape[0]
            atype = np.tile(frames[f"{group}/atype"], (nf, 1))
            box = frames[f"{group}/box"].reshape(nf, 9) if f"{group}/box" in frames else None
            result = evaluate(desc, coord.reshape(nf, -1), atype, box)
            out[f"{name}/{group}"] = np.asarray(result, dtype=np.float64)
    np.savez(job["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
