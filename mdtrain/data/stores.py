"""Which storage a system path names: a deepmd/npy folder, an HDF5 group (``file.h5#/group``
or a file whose root is a system) or a group of DeePMD-kit's LMDB; checked to exist, nothing
else read."""

from __future__ import annotations

import os

from mdtrain.data.hdf5 import H5Store, find_h5_systems, is_hdf5, split_h5_path
from mdtrain.data.lmdb_store import LmdbStore, is_lmdb, single_group
from mdtrain.data.npy import Listing, NpyStore
from mdtrain.errors import MDTrainError


def open_store(
    path: str, list_sets: bool = True, listing: Listing | None = None
) -> NpyStore | H5Store | LmdbStore:
    """The storage of the system at ``path`` (checked to exist; nothing else is read);
    ``list_sets``: see `NpyStore`; ``listing``: the entries of the folder ``path``, just
    listed by `expand_systems` (then it is not looked at again)."""
    path = str(path)
    if listing is not None and "#" not in path and not listing.files.get("data.mdb"):
        return NpyStore(path, list_sets, listing)
    if is_lmdb(path):
        return LmdbStore(path if "#" in path else single_group(path))
    if "#" in path:
        file, group = split_h5_path(path)
        if not os.path.isfile(file):
            raise MDTrainError(f"system {path}: HDF5 file {file} does not exist")
        if not is_hdf5(file):
            raise MDTrainError(f"system {path}: {file} is not an HDF5 file")
        return H5Store(file, group)
    if os.path.isdir(path):
        return NpyStore(path, list_sets)
    if os.path.isfile(path):
        if not is_hdf5(path):
            raise MDTrainError(
                f"system {path}: a file that is not HDF5 (expected a directory with type.raw, "
                "file.h5 or file.h5#/group)"
            )
        groups = find_h5_systems(path)
        if "/" in groups:
            return H5Store(path, "/")
        raise MDTrainError(
            f"system {path}: the HDF5 file holds {len(groups)} systems; name one as "
            f"{path}#/group or list the file in 'systems' to use them all"
        )
    raise MDTrainError(f"system {path} does not exist")
