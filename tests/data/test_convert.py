"""mdtrain convert: ASE/dpdata inputs → deepmd/npy or deepmd/hdf5, read back with open_system."""

from __future__ import annotations

import os

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.stress import voigt_6_to_full_3x3_stress

from mdtrain.cli import main
from mdtrain.data import expand_systems, open_system
from mdtrain.data.readers import resolve_format
from tests.helpers.datagen import random_water_like


def _images(nframes: int, nmol: int, seed: int, with_stress: bool = True) -> list[Atoms]:
    """Labelled water-like frames with random energy, forces and (symmetric) stress."""
    coords, types, boxes = random_water_like(
        nframes, nmol, 3.2 * int(np.ceil(nmol ** (1 / 3))), seed
    )
    rng = np.random.default_rng(seed)
    images = []
    for f in range(nframes):
        atoms = Atoms(
            symbols=["O" if t == 0 else "H" for t in types],
            positions=coords[f],
            cell=boxes[f],
            pbc=True,
        )
        results = {"energy": rng.normal() - 10.0, "forces": rng.normal(size=(len(types), 3))}
        if with_stress:
            results["stress"] = rng.normal(size=6) * 0.01
        atoms.calc = SinglePointCalculator(atoms, **results)
        images.append(atoms)
    return images


def _convert(*argv) -> None:
    assert main(["convert", *map(str, argv)]) == 0


def _sorted_by(symbols: list[str], type_map: list[str]) -> np.ndarray:
    return np.argsort([type_map.index(s) for s in symbols], kind="stable")


def test_extxyz_to_npy_round_trip(tmp_path):
    images = _images(5, 8, seed=1) + _images(3, 1, seed=2)  # two compositions
    ase.io.write(tmp_path / "frames.xyz", images, format="extxyz")
    images = ase.io.read(tmp_path / "frames.xyz", ":")  # as stored (text precision)
    _convert(tmp_path / "frames.xyz", "-o", tmp_path / "out", "--set-size", "2")
    systems = expand_systems(str(tmp_path / "out"))
    assert [os.path.basename(p) for p in systems] == ["O1H2", "O8H16"]
    big = open_system(systems[1], ["O", "H"])
    assert (big.nframes, [s.name for s in big.sets]) == (5, ["set.000", "set.001", "set.002"])
    assert big.elements == ["O", "H"]
    order = _sorted_by(images[0].get_chemical_symbols(), ["O", "H"])
    frames = big.frames(range(5))
    for f, atoms in enumerate(images[:5]):
        np.testing.assert_allclose(frames["coord"][f], atoms.positions[order], atol=1e-12)
        np.testing.assert_allclose(frames["box"][f], atoms.cell[:], atol=1e-12)
        np.testing.assert_allclose(frames["force"][f], atoms.get_forces()[order], atol=1e-12)
        assert frames["energy"][f] == pytest.approx(atoms.get_potential_energy(), abs=1e-12)
        # virial = -V σ, σ = (1/V) dE/dε as ASE defines its stress
        stress = voigt_6_to_full_3x3_stress(atoms.get_stress())
        np.testing.assert_allclose(frames["virial"][f], -stress * atoms.get_volume(), atol=1e-12)


def test_virial_sign_follows_a_physical_stress(tmp_path):
    """Compressed atoms push outwards: ASE stress < 0, so the virial must be > 0."""
    from ase.calculators.morse import MorsePotential

    atoms = Atoms("Ar8", cell=np.eye(3) * 3.2, pbc=True)
    atoms.positions = np.indices((2, 2, 2)).reshape(3, -1).T * 1.6
    atoms.calc = MorsePotential(epsilon=0.1, r0=2.0, rho0=5.0)
    stress = atoms.get_stress()
    assert (stress[:3] < 0).all()
    atoms.calc = SinglePointCalculator(
        atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces(), stress=stress
    )
    ase.io.write(tmp_path / "ar.extxyz", [atoms])
    _convert(tmp_path / "ar.extxyz", "-o", tmp_path / "out")
    virial = open_system(str(tmp_path / "out" / "Ar8")).frames([0])["virial"][0]
    assert (np.diag(virial) > 0).all()


def test_type_order_and_hdf5_output(tmp_path):
    images = _images(4, 8, seed=3)
    ase.io.write(tmp_path / "a.extxyz", images)
    images = ase.io.read(tmp_path / "a.extxyz", ":")
    _convert(tmp_path / "a.extxyz", "-o", tmp_path / "d.h5", "-t", "H", "O", "C")
    systems = expand_systems(str(tmp_path / "d.h5"))
    assert systems == [f"{tmp_path / 'd.h5'}#/H16O8"]
    own = open_system(systems[0])  # types as written: H = 0 first
    assert own.elements == ["H", "O", "C"]
    np.testing.assert_array_equal(own.atype, [0] * 16 + [1] * 8)
    model = open_system(systems[0], ["O", "H"])
    order = _sorted_by(images[0].get_chemical_symbols(), ["O", "H"])
    np.testing.assert_allclose(model.frames([2])["coord"][0], images[2].positions[order])


def test_valid_split_is_random_and_seeded(tmp_path):
    ase.io.write(tmp_path / "a.xyz", _images(10, 1, seed=4))
    _convert(tmp_path / "a.xyz", "-o", tmp_path / "s1", "--valid-fraction", "0.3", "--seed", "7")
    _convert(tmp_path / "a.xyz", "-o", tmp_path / "s2", "--valid-fraction", "0.3", "--seed", "7")
    _convert(tmp_path / "a.xyz", "-o", tmp_path / "s3", "--valid-fraction", "0.3", "--seed", "8")

    def energies(root, part):
        return open_system(str(tmp_path / root / part / "O1H2")).frames(
            range(7 if part == "train" else 3)
        )["energy"]

    all_energies = np.array(
        [a.get_potential_energy() for a in ase.io.read(tmp_path / "a.xyz", ":")]
    )
    train, valid = energies("s1", "train"), energies("s1", "valid")
    assert len(train) == 7 and len(valid) == 3
    np.testing.assert_allclose(np.sort(np.concatenate([train, valid])), np.sort(all_energies))
    np.testing.assert_array_equal(energies("s2", "valid"), valid)  # same seed, same split
    assert not np.array_equal(energies("s3", "valid"), valid)  # another seed, another split
    assert open_system(str(tmp_path / "s1/valid/O1H2")).nframes == 3
    with pytest.raises(IndexError):
        open_system(str(tmp_path / "s1/valid/O1H2")).frames([3])


def test_npy_to_hdf5_and_back(tmp_path, water_system):
    _convert(water_system, "-o", tmp_path / "w.h5")
    (converted,) = expand_systems(str(tmp_path / "w.h5"))
    a, b = open_system(water_system, ["O", "H"]), open_system(converted, ["O", "H"])
    np.testing.assert_array_equal(a.atype, b.atype)
    everything = range(a.nframes)
    for key, value in a.frames(everything).items():
        np.testing.assert_array_equal(value, b.frames(everything)[key])


def test_dpdata_reader_without_labels(tmp_path):
    atoms = _images(1, 1, seed=5)[0]
    ase.io.write(tmp_path / "POSCAR", atoms, format="vasp")
    _convert(tmp_path / "POSCAR", "-o", tmp_path / "out", "-f", "vasp/poscar", "-t", "O", "H")
    system = open_system(str(tmp_path / "out" / "O1H2"), ["O", "H"])
    assert not any(system.has(k) for k in ("energy", "force", "virial"))
    order = _sorted_by(atoms.get_chemical_symbols(), ["O", "H"])
    np.testing.assert_allclose(system.frames([0])["coord"][0], atoms.positions[order], atol=1e-6)


def test_dpdata_labelled_reader(tmp_path, water_system):
    import dpdata

    dpdata.LabeledSystem(water_system, fmt="deepmd/npy").to("deepmd/raw", str(tmp_path / "raw"))
    _convert(tmp_path / "raw", "-o", tmp_path / "out", "-f", "deepmd/raw")
    a = open_system(water_system, ["O", "H"])
    b = open_system(str(tmp_path / "out" / "O8H16"), ["O", "H"])
    assert b.labels == {"energy", "force", "virial"}
    everything = range(a.nframes)
    for key, value in a.frames(everything).items():
        np.testing.assert_allclose(b.frames(everything)[key], value, rtol=1e-12, atol=1e-12)


def test_nopbc_and_partial_labels(tmp_path, capsys):
    images = _images(3, 1, seed=6, with_stress=False)
    for atoms in images:
        atoms.pbc = False
    images[1].calc = SinglePointCalculator(images[1], energy=1.0)  # no forces in this frame
    ase.io.write(tmp_path / "c.xyz", images)
    _convert(tmp_path / "c.xyz", "-o", tmp_path / "out")
    assert "force dropped: only 2 of 3 frames" in capsys.readouterr().err
    system = open_system(str(tmp_path / "out" / "O1H2_nopbc"))
    assert not system.periodic and system.has("energy") and not system.has("force")


def test_auto_format_guess(tmp_path, water_system):
    assert resolve_format("run/OUTCAR", "auto") == ("dpdata", "vasp/outcar")
    assert resolve_format("vasprun.xml", "auto") == ("dpdata", "vasp/xml")
    assert resolve_format("md.extxyz", "auto") == ("ase", "extxyz")
    assert resolve_format("traj.lammpstrj", "auto") == ("dpdata", "lammps/dump")
    assert resolve_format(water_system, "auto") == ("deepmd", None)
    assert resolve_format("data.h5#/water", "auto") == ("deepmd", None)
    assert resolve_format("x", "extxyz") == ("ase", "extxyz")
    assert resolve_format("x", "vasp/outcar") == ("dpdata", "vasp/outcar")
    assert resolve_format("x", "ase/traj") == ("dpdata", "ase/traj")


def test_convert_errors(tmp_path, capsys):
    ase.io.write(tmp_path / "a.xyz", _images(2, 1, seed=7))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    cases = [
        (["-o", tmp_path / "busy"], "already exists"),
        (["-o", tmp_path / "o1", "-t", "O"], "element H is not in -t O"),
        (["-o", tmp_path / "o2", "-f", "no-such-format"], "unknown format"),
        (["-o", tmp_path / "o3", "--valid-fraction", "1.5"], "--valid-fraction"),
    ]
    for extra, message in cases:
        assert main(["convert", str(tmp_path / "a.xyz"), *map(str, extra)]) == 1
        assert message in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.xyz"), "-o", str(tmp_path / "o4")]) == 1
    assert "no such file" in capsys.readouterr().err
    mixed = _images(1, 1, seed=8)[0]
    mixed.pbc = [True, True, False]
    ase.io.write(tmp_path / "slab.xyz", mixed)
    assert main(["convert", str(tmp_path / "slab.xyz"), "-o", str(tmp_path / "o5")]) == 1
    assert "partly periodic" in capsys.readouterr().err
