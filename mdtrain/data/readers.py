"""Read DFT/MD outputs into plain frame blocks, through dpdata, ASE or mdtrain's own reader.

A block is a run of frames with the same atoms in the same order: per-atom element names,
coordinates, an optional cell and whichever labels the source has (energy in eV, force in
eV/Å, virial in eV). ASE reports stress as ``σ = (1/V) ∂E/∂ε``; the DeePMD-compatible virial
is ``W = -∂E/∂ε = -V σ``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from mdtrain.data.hdf5 import is_hdf5
from mdtrain.errors import MDTrainError

log = logging.getLogger("mdtrain.convert")

DEEPMD_FORMATS = ("deepmd", "deepmd/npy", "deepmd/hdf5")


@dataclass
class Block:
    """Frames of one source with fixed atoms: ``symbols[i]`` names atom i."""

    source: str
    symbols: np.ndarray  # (natoms,) str
    coord: np.ndarray  # (nf, natoms, 3)
    box: np.ndarray | None  # (nf, 3, 3) or None when non-periodic
    energy: np.ndarray | None = None
    force: np.ndarray | None = None
    virial: np.ndarray | None = None


def resolve_format(path: str, fmt: str) -> tuple[str, str | None]:
    """Which reader takes ``path``: ``("deepmd"|"dpdata"|"ase", format name)``.

    "auto" guesses from the name: OUTCAR* → vasp/outcar, vasprun*.xml → vasp/xml,
    *.xyz/*.extxyz → ASE extxyz, *.dump/*.lammpstrj → lammps/dump, a system directory or
    HDF5 file → deepmd; anything else is left to ASE's own guess. An explicit name that ASE
    knows (extxyz, vasp-out, ...) goes to ASE, other names to dpdata; ``ase/NAME`` forces ASE.
    """
    if fmt != "auto":
        return _explicit_format(fmt)
    base = os.path.basename(os.path.normpath(path)).lower()
    if "#" in path or os.path.isdir(path) or is_hdf5(path):
        return "deepmd", None
    if base.startswith("outcar"):
        return "dpdata", "vasp/outcar"
    if base.startswith("vasprun") and base.endswith(".xml"):
        return "dpdata", "vasp/xml"
    if base.endswith((".xyz", ".extxyz")):
        return "ase", "extxyz"
    if base.endswith((".dump", ".lammpstrj")) or base == "dump":
        return "dpdata", "lammps/dump"
    return "ase", None


def _explicit_format(fmt: str) -> tuple[str, str | None]:
    from ase.io.formats import ioformats
    from dpdata.format import Format

    dpdata_formats = Format.get_formats()
    if fmt in DEEPMD_FORMATS:
        return "deepmd", None
    if fmt.startswith("ase/") and fmt not in dpdata_formats:
        return "ase", fmt[4:]
    if fmt in ioformats:
        return "ase", fmt
    if fmt in dpdata_formats:
        return "dpdata", fmt
    raise MDTrainError(
        f"-f {fmt}: unknown format (give a dpdata format such as vasp/outcar or an ASE one "
        "such as extxyz)"
    )


def read_blocks(path: str, fmt: str, type_map: list[str] | None) -> list[Block]:
    """All frames of one input file or directory."""
    if not os.path.exists(path.partition("#")[0]):
        raise MDTrainError(f"{path}: no such file or directory")
    reader, name = resolve_format(path, fmt)
    if reader == "deepmd":
        return _read_deepmd(path, type_map)
    if reader == "dpdata":
        return _read_dpdata(path, name, type_map)
    return _read_ase(path, name)


def _read_deepmd(path: str, type_map: list[str] | None) -> list[Block]:
    from mdtrain.data.expand import expand_systems
    from mdtrain.data.mixed import open_all

    blocks = []
    for system in open_all(expand_systems([path]), type_map):
        names = np.array(type_map or system.elements)
        frames = system.frames(np.arange(system.nframes))
        blocks.append(
            Block(
                source=system.path,
                symbols=names[system.atype],
                coord=frames["coord"],
                box=frames.get("box"),
                energy=frames.get("energy"),
                force=frames.get("force"),
                virial=frames.get("virial"),
            )
        )
    return blocks


def _read_dpdata(path: str, fmt: str, type_map: list[str] | None) -> list[Block]:
    import dpdata

    kwargs = {"fmt": fmt}
    if type_map:
        kwargs["type_map"] = list(type_map)
    systems = None
    errors = []
    for make in (dpdata.LabeledSystem, dpdata.System):
        try:
            systems = [make(path, **kwargs)]
            break
        except Exception as exc:  # dpdata raises many kinds; report the first below
            errors.append(exc)
    if systems is None:
        try:
            extra = {"type_map": list(type_map)} if type_map else {}
            systems = list(dpdata.MultiSystems.from_file(path, fmt=fmt, **extra))
        except Exception:
            raise MDTrainError(f"{path}: dpdata cannot read it as {fmt} ({errors[0]})") from None
    return [_dpdata_block(path, s) for s in systems if s.get_nframes() > 0]


def _dpdata_block(path: str, system) -> Block:
    data = system.data
    names = np.array(data["atom_names"])
    nopbc = bool(data.get("nopbc", False))
    return Block(
        source=path,
        symbols=names[np.asarray(data["atom_types"])],
        coord=np.asarray(data["coords"], dtype=np.float64),
        box=None if nopbc else np.asarray(data["cells"], dtype=np.float64),
        energy=_maybe(data, "energies"),
        force=_maybe(data, "forces"),
        virial=_maybe(data, "virials"),
    )


def _maybe(data: dict, key: str) -> np.ndarray | None:
    value = data.get(key)
    return None if value is None else np.asarray(value, dtype=np.float64)


def _read_ase(path: str, fmt: str | None) -> list[Block]:
    import ase.io

    try:
        images = ase.io.read(path, index=":", format=fmt)
    except Exception as exc:  # ASE raises many kinds; one line is enough for the user
        how = f"as {fmt}" if fmt else "(format guessed; give -f)"
        raise MDTrainError(f"{path}: ASE cannot read it {how}: {exc}") from None
    return [_ase_block(f"{path}[{k}]", atoms) for k, atoms in enumerate(images)]


def _ase_block(source: str, atoms) -> Block:
    from ase.stress import voigt_6_to_full_3x3_stress

    pbc = np.asarray(atoms.pbc, dtype=bool)
    if pbc.any() and not pbc.all():
        raise MDTrainError(f"{source}: partly periodic cell (pbc={pbc.tolist()}) not supported")
    periodic = bool(pbc.all())
    cell = np.asarray(atoms.cell[:], dtype=np.float64)
    if periodic and abs(np.linalg.det(cell)) < 1e-8:
        raise MDTrainError(f"{source}: periodic but the cell has zero volume")
    results = atoms.calc.results if atoms.calc is not None else {}
    energy = results.get("energy", results.get("free_energy"))
    forces = results.get("forces")
    stress = results.get("stress")
    virial = None
    if stress is not None and periodic:
        stress = np.asarray(stress, dtype=np.float64)
        full = voigt_6_to_full_3x3_stress(stress) if stress.shape == (6,) else stress
        virial = -full * abs(np.linalg.det(cell))
    return Block(
        source=source,
        symbols=np.array(atoms.get_chemical_symbols()),
        coord=np.asarray(atoms.positions, dtype=np.float64)[None],
        box=cell[None] if periodic else None,
        energy=None if energy is None else np.array([float(energy)]),
        force=None if forces is None else np.asarray(forces, dtype=np.float64)[None],
        virial=None if virial is None else virial[None],
    )
