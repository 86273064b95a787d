"""The statistics cache (``training.stat_file``, HDF5): reading, writing, and the keys that
make a cached entry valid. ``stats/`` computes the numbers; this module only stores them.

Layout: ``/<type_map joined by spaces>/<sha1 of the descriptor settings>/{r_0, a_0, r_1, ...}`` (the
descriptor's ``stat_groups`` per type)
and ``/<type_map>/bias_atom_energy``, ``std_atom_energy`` (ntypes, 1); a DOS or property
model's ``/<type_map>/<sha1 of its output settings>/bias_atom_<name>``, ``std_atom_<name>``
(ntypes, values per atom; DeePMD-kit's names, ``<name>`` ``dos`` or the ``property_name``). The hash covers every
setting that changes the numbers (the descriptor's ``stat_settings``: type, rcut, rcut_smth,
sel, exclusions, env_protection), at full
precision, so a changed setting never reuses stale entries. The root attribute ``DATA_ATTR``
holds a summary of the training data, to warn when the file is reused for other data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mdtrain.errors import MDTrainError


def descriptor_stat_hash(model) -> str:
    """sha1 of every descriptor setting the env-matrix sums depend on."""
    settings = model.descriptor.stat_settings()
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def output_stat_hash(model) -> str:
    """sha1 of every setting a DOS or property model's output statistics depend on (its
    output, width, ``intensive``, ``distinguish_types``, excluded types and ``rcond``)."""
    fit = model.get_model_config()["fitting_net"]
    settings = {
        "output": model.output,
        "width": int(model.width),
        "intensive": bool(model.intensive),
        "distinguish_types": bool(model.distinguish_types),
        "excluded": [int(t) for t in model.excluded],
        "rcond": fit.get("rcond"),
    }
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()


DATA_ATTR = "mdtrain_training_data"


def data_summary(systems: Sequence[Any]) -> str:
    """A cheap identity of a training set: its systems' sizes (frames, atoms), in any order
    and wherever they lie. Stored in the stat file to warn when it is reused for other data."""
    sizes = sorted((int(s.nframes), int(s.natoms)) for s in systems)
    return hashlib.sha1(json.dumps(sizes).encode()).hexdigest()


def read_stat_file(path: str) -> dict[str, np.ndarray]:
    """All datasets of an HDF5 stat file, keyed by their path (no leading slash)."""
    return read_stat_file_and_attrs(path)[0]


def read_stat_file_and_attrs(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The datasets and the string attributes of the root, in one opening of the file."""
    import h5py  # only here: neighbor-stat and train start without it

    if not os.path.exists(path):
        return {}, {}
    out: dict[str, np.ndarray] = {}
    try:
        with h5py.File(path, "r") as f:
            f.visititems(
                lambda name, obj: (
                    out.__setitem__(name, np.asarray(obj[()]))
                    if isinstance(obj, h5py.Dataset)
                    else None
                )
            )
            attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in f.attrs.items()}
    except OSError as err:
        raise MDTrainError(
            f"training/stat_file: {path} is not a readable HDF5 file ({err})"
        ) from err
    return out, attrs


def write_stat_file(
    path: str, entries: dict[str, np.ndarray], attrs: dict[str, str] | None = None
) -> None:
    """Add or replace datasets (and root attributes), keeping all others; written to a temp
    file then renamed."""
    import h5py  # only here: neighbor-stat and train start without it

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as dst:
            if os.path.exists(path):
                with h5py.File(path, "r") as src:
                    for name in src:
                        src.copy(src[name], dst, name=name)
                    dst.attrs.update(src.attrs)
            dst.attrs.update(attrs or {})
            for name, value in entries.items():
                if name in dst:
                    del dst[name]
                dst.create_dataset(name, data=np.asarray(value, dtype=np.float64))
        os.replace(tmp, path)
    except OSError as err:
        raise MDTrainError(f"training/stat_file: cannot write {path} ({err})") from err
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
