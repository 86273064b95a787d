"""Conversion of DFT/MD outputs → deepmd/npy directories or a deepmd/hdf5 file (for
``mdtrain convert``).

Frames are grouped into one system per composition (and periodicity), atoms sorted by the
type order (``-t``, else order of first appearance), optionally split into train/ and valid/
by random frames, and written in ``set.*`` chunks of ``--set-size`` frames. The mixed-type
outputs (``deepmd/npy/mixed``, ``deepmd/hdf5/mixed``, as dpdata names them) then join the
compositions of one atom count (padded up to a multiple of ``atom_numb_pad`` with virtual
atoms, type -1) and periodicity into one system named by that count (``12``, ``12_nopbc``),
whose ``set.*/real_atom_types.npy`` gives each frame's types.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import numpy as np

from mdtrain.data.readers import Block, read_blocks
from mdtrain.data.write import SystemData, write_hdf5, write_npy
from mdtrain.errors import MDTrainError
from mdtrain.progress import progress

log = logging.getLogger("mdtrain.convert")
_LABELS = ("energy", "force", "virial")


def convert(
    inputs: list[str],
    output: str,
    to: str,
    fmt: str = "auto",
    type_map: list[str] | None = None,
    valid_fraction: float = 0.0,
    seed: int = 0,
    set_size: int = 5000,
    atom_numb_pad: int | None = None,
) -> dict[str, dict[str, SystemData]]:
    """Read ``inputs`` (format ``fmt``, dpdata or ASE names), group and split the frames, write
    them to ``output`` as ``to`` (``deepmd/npy`` or ``deepmd/hdf5``, either with ``/mixed``);
    returns the systems written per part (``""``, or ``"train"`` and ``"valid"``)."""
    _check_output_free(output, to.removesuffix("/mixed"))
    blocks: list[Block] = []
    for path in progress(inputs, len(inputs), "reading"):
        blocks.extend(read_blocks(path, fmt, type_map))
    if not blocks:
        raise MDTrainError(f"no frames found in {' '.join(inputs)}")
    systems = group_frames(blocks, _type_map(blocks, type_map))
    splits = split_frames(systems, valid_fraction, seed)
    if to.endswith("/mixed"):
        splits = {part: mix_systems(group, atom_numb_pad) for part, group in splits.items()}
    _write(output, to.removesuffix("/mixed"), splits, set_size)
    return splits


def _check_output_free(output: str, to: str) -> None:
    if to == "deepmd/hdf5":
        if os.path.exists(output):
            raise MDTrainError(f"-o {output}: already exists; remove it or choose another name")
    elif os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise MDTrainError(f"-o {output}: already exists and is not an empty directory")


def _type_map(blocks: list[Block], given: list[str] | None) -> list[str]:
    """``-t`` (checked to name every element), else elements in order of first appearance."""
    if given:
        if len(set(given)) != len(given):
            raise MDTrainError(f"-t {' '.join(given)}: an element is listed twice")
        for block in blocks:
            missing = sorted(set(block.symbols.tolist()) - set(given))
            if missing:
                raise MDTrainError(
                    f"{block.source}: element {', '.join(missing)} is not in -t {' '.join(given)}"
                )
        return list(given)
    seen: dict[str, None] = {}
    for block in blocks:
        for symbol in block.symbols.tolist():
            seen.setdefault(symbol, None)
    return list(seen)


def group_frames(blocks: list[Block], type_map: list[str]) -> dict[str, SystemData]:
    """One system per composition and periodicity, named like ``O64H128`` (``_nopbc``)."""
    index = {name: t for t, name in enumerate(type_map)}
    groups: dict[tuple, list[tuple[Block, np.ndarray]]] = defaultdict(list)
    for block in blocks:
        types = np.array([index[s] for s in block.symbols.tolist()], dtype=np.int64)
        order = np.argsort(types, kind="stable")
        key = (tuple(types[order].tolist()), block.box is not None)
        groups[key].append((block, order))
    systems = {}
    for (types, periodic), members in groups.items():
        counts = np.bincount(types, minlength=len(type_map))
        name = "".join(f"{type_map[t]}{counts[t]}" for t in range(len(type_map)) if counts[t])
        name += "" if periodic else "_nopbc"
        systems[name] = _merge(name, np.array(types), type_map, members)
    return dict(sorted(systems.items()))


def _merge(name, types, type_map, members) -> SystemData:
    def stack(attr: str, per_atom: bool) -> np.ndarray | None:
        parts = [getattr(b, attr) for b, _ in members]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            have = sum(len(p) for p in parts if p is not None)
            total = sum(len(b.coord) for b, _ in members)
            log.warning("%s: %s dropped: only %d of %d frames have it", name, attr, have, total)
            return None
        return np.concatenate(
            [p[:, order] if per_atom else p for p, (_, order) in zip(parts, members, strict=True)]
        )

    return SystemData(
        types=types,
        type_map=list(type_map),
        coord=stack("coord", True),
        box=stack("box", False),
        energy=stack("energy", False),
        force=stack("force", True),
        virial=stack("virial", False),
    )


def mix_systems(
    systems: dict[str, SystemData], atom_numb_pad: int | None = None
) -> dict[str, SystemData]:
    """The mixed-type systems of ``systems``: one per atom count (rounded up to a multiple of
    ``atom_numb_pad``, the rest virtual atoms) and periodicity; see the module doc."""
    pad = max(1, atom_numb_pad or 1)
    groups: dict[str, list[SystemData]] = defaultdict(list)
    for data in systems.values():
        natoms = -(-len(data.types) // pad) * pad
        groups[f"{natoms}{'' if data.box is not None else '_nopbc'}"].append(data)
    mixed = {}
    for name, members in groups.items():
        natoms = int(name.partition("_")[0])
        parts = [_padded(data, natoms) for data in members]

        def join(attr: str, parts=parts, name=name) -> np.ndarray | None:
            values = [getattr(p, attr) for p in parts]
            if any(v is None for v in values):
                if any(v is not None for v in values):
                    log.warning("%s: %s dropped: only some compositions have it", name, attr)
                return None
            return np.concatenate(values)

        mixed[name] = SystemData(
            types=np.zeros(natoms, dtype=np.int64),
            type_map=members[0].type_map,
            **{a: join(a) for a in ("coord", "box", "energy", "force", "virial", "real_types")},
        )
    return dict(sorted(mixed.items(), key=lambda item: (len(item[0]), item[0])))


def _padded(data: SystemData, natoms: int) -> SystemData:
    """``data`` with its types per frame, padded with virtual atoms to ``natoms``."""
    nf, extra = data.nframes, natoms - len(data.types)
    types = np.concatenate([np.asarray(data.types, dtype=np.int64), np.full(extra, -1)])

    def pad(values: np.ndarray | None) -> np.ndarray | None:
        if values is None or not extra:
            return values
        return np.concatenate([values, np.zeros((nf, extra, 3))], axis=1)

    return SystemData(
        types=types, type_map=data.type_map, coord=pad(data.coord), box=data.box,
        energy=data.energy, force=pad(data.force), virial=data.virial,
        real_types=np.repeat(types[None], nf, axis=0),
    )  # fmt: skip


def split_frames(
    systems: dict[str, SystemData], valid_fraction: float, seed: int
) -> dict[str, dict[str, SystemData]]:
    """``{"": systems}``, or ``{"train": ..., "valid": ...}`` split by random frames.

    Each system with at least two frames gives ``round(fraction · nframes)`` frames (at
    least one, at most all but one) to validation; frames keep their order in each part.
    """
    if valid_fraction <= 0:
        return {"": systems}
    rng = np.random.default_rng(seed)
    train, valid = {}, {}
    for name, data in systems.items():
        nf = data.nframes
        n_valid = min(max(round(valid_fraction * nf), 1), nf - 1)
        perm = rng.permutation(nf)
        if n_valid > 0:
            valid[name] = data.take(np.sort(perm[:n_valid]))
        else:
            log.warning("%s: only %d frame, kept for training", name, nf)
        train[name] = data.take(np.sort(perm[n_valid:]))
    return {"train": train, "valid": valid}


def _write(output: str, to: str, splits: dict, set_size: int) -> None:
    items = [(part, name, data) for part, group in splits.items() for name, data in group.items()]
    if to == "deepmd/npy":
        for part, name, data in progress(items, len(items), "writing"):
            write_npy(os.path.join(output, part, name), data, set_size)
        return
    import h5py

    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    with h5py.File(output, "w") as handle:
        for part, name, data in progress(items, len(items), "writing"):
            write_hdf5(handle, f"{part}/{name}" if part else name, data, set_size)
