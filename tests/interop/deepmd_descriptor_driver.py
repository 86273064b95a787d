"""DeePMD-kit's side of the descriptor interop test, run with DeePMD-kit's own Python.

It imports neither mdtrain nor torch. One JSON job file::

    {"models": "models.npz", "frames": "frames.npz", "out": "out.npz"}

``models.npz`` holds serialised descriptors (``tests/helpers/serialized_npz.py``; names in
its ``names`` entry); ``frames.npz`` groups of frames (``<group>/coord`` (nf, N, 3),
``<group>/atype`` (N,), optional ``<group>/box`` (nf, 3, 3); group names in ``groups``).
Each model is read by DeePMD-kit's own ``deserialize`` of its type and evaluated on every
group with DeePMD-kit's type-mixed neighbour list; ``out.npz`` receives
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
from deepmd.dpmodel.descriptor import DescrptDPA1, DescrptSeAttenV2, DescrptSeTTebd  # noqa: E402
from deepmd.dpmodel.utils.nlist import extend_input_and_build_neighbor_list  # noqa: E402
from deepmd.utils import argcheck  # noqa: E402

from tests.helpers.serialized_npz import entries, read  # noqa: E402

CLASSES = {"dpa1": DescrptDPA1, "se_atten_v2": DescrptSeAttenV2, "se_e3_tebd": DescrptSeTTebd}
ARGS = {
    "se_atten": argcheck.descrpt_se_atten_args,
    "se_atten_v2": argcheck.descrpt_se_atten_v2_args,
    "se_e3_tebd": argcheck.descrpt_se_e3_tebd_args,
}


def defaults(kind: str) -> dict:
    """argcheck's filled section for a section with only ``sel``."""
    arg = Argument("descriptor", dict, sub_fields=ARGS[kind]())
    return arg.normalize_value({"sel": 10}, trim_pattern="_*")


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    models, frames = np.load(job["models"]), np.load(job["frames"])
    out: dict[str, np.ndarray] = {}
    for kind in ARGS:
        out[f"defaults/{kind}"] = np.array(json.dumps(defaults(kind)))
    for name in json.loads(str(models["names"])):
        data = read(models, name)
        desc = CLASSES[data["type"]].deserialize(data)
        out.update(entries(f"{name}/again", desc.serialize()))
        for group in json.loads(str(frames["groups"])):
            coord = frames[f"{group}/coord"]
            nf = coord.shape[0]
            atype = np.tile(frames[f"{group}/atype"], (nf, 1))
            box = frames[f"{group}/box"].reshape(nf, 9) if f"{group}/box" in frames else None
            ext_coord, ext_atype, mapping, nlist = extend_input_and_build_neighbor_list(
                coord.reshape(nf, -1), atype, desc.get_rcut(), desc.get_sel(), True, box
            )
            result = desc.call(ext_coord.reshape(nf, -1), ext_atype, nlist, mapping)
            out[f"{name}/{group}"] = np.asarray(result[0], dtype=np.float64)
    np.savez(job["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
