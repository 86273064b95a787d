"""benchmarks/deepmd_examples.py's own parts, without DeePMD-kit: dp test's log and mdtrain
test's JSON parsed into the same names, the comparison and verdict, the table, which JSON files
count as training inputs, relative paths made absolute, the short run and the test systems."""

from __future__ import annotations

import json

from tests.helpers.benchmarks import benchmark_module

ex = benchmark_module("deepmd_examples")

DP_LOG = """\
[2026-11-26 04:54:25,096] DEEPMD INFO    # testing system : /d/data_3
[2026-11-26 04:54:25,096] DEEPMD INFO    Energy MAE         : 5.824407e+01 eV
[2026-11-26 04:54:25,096] DEEPMD INFO    Energy RMSE        : 5.824427e+01 eV
[2026-11-26 04:54:25,096] DEEPMD INFO    Energy RMSE/Natoms : 3.033556e-01 eV
[2026-11-26 04:54:25,096] DEEPMD INFO    Force  RMSE        : 8.288683e-01 eV/Å
[2026-11-26 04:54:25,096] DEEPMD INFO    Force weighted RMSE: 9.000000e-01 eV/Å
[2026-11-26 04:54:25,096] DEEPMD INFO    Virial RMSE        : 1.500000e+00 eV
[2026-11-26 04:54:25,096] DEEPMD INFO    Virial RMSE/Natoms : 7.812500e-03 eV
[2026-11-26 04:54:25,096] DEEPMD INFO    # ----------weighted average of errors-----------
[2026-11-26 04:54:25,103] DEEPMD INFO    Energy RMSE        : 9.999999e+01 eV
"""


def test_dp_log_first_block_only_and_named_like_mdtrain():
    got = ex.parse_dp_test(DP_LOG)
    assert got == {
        "energy": 58.24427,
        "energy/atom": 0.3033556,
        "force": 0.8288683,
        "virial": 1.5,
        "virial/atom": 0.0078125,
    }


def test_dp_tensor_dos_property_lines():
    log = (
        "Dipole  RMSE       : 1.000000e-01\nDipole  RMSE/sqrtN : 5.0e-02\n"
        "Dipole  RMSE/N     : 2.0e-02\n"
    )
    assert ex.parse_dp_test(log) == {"dipole": 0.1}
    assert ex.parse_dp_test(log, atomic=True) == {"atomic_dipole": 0.1}
    assert ex.parse_dp_test("Polarizability  RMSE       : 3.0e+00\n") == {"polarizability": 3.0}
    log = (
        "DOS MAE            : 1.0e+00 Occupation/eV\n"
        "DOS RMSE           : 2.0e+00 Occupation/eV\n"
        "DOS RMSE/Natoms    : 4.0e-01 Occupation/eV\n"
        "Atomic DOS RMSE    : 5.0e-01 Occupation/eV\n"
        "PROPERTY RMSE           : 6.0e+00 units\n"
        "Atomic PROPERTY RMSE    : 7.0e+00 units\n"
    )
    assert ex.parse_dp_test(log) == {
        "dos": 2.0,
        "dos/atom": 0.4,
        "atom_dos": 0.5,
        "property": 6.0,
        "atom_property": 7.0,
    }


def test_mdtrain_json_total_and_verdict():
    data = {
        "systems": {"/d/data_3": {"energy_rmse": 1.0}},
        "total": {"energy_rmse": 58.244271, "energy_mae": 58.0, "energy_rmse_per_atom": 0.3033556,
                  "force_rmse": 0.82886830001, "atomic_dipole_rmse": 0.2},
    }  # fmt: skip
    ours = ex.parse_mdtrain_json(data)
    assert ours == {"energy": 58.244271, "energy/atom": 0.3033556, "force": 0.82886830001,
                    "atomic_dipole": 0.2}  # fmt: skip
    row = ex.Row("water/x.json", system="data_3", mdtrain=ours, deepmd=ex.parse_dp_test(DP_LOG))
    row.judge()
    assert row.status == "pass" and 0 < row.max_rel < 1e-6
    row.deepmd["force"] = 0.8288693  # 1.2e-6 relative apart: fails float64, passes float32
    row.judge()
    assert row.status == "fail" and abs(row.max_rel - 1e-6 / 0.8288693) < 1e-9
    row.precision = "float32"
    row.judge()
    assert row.status == "pass"
    empty = ex.Row("a.json", mdtrain={"dos": 1.0}, deepmd={"energy": 1.0})
    empty.judge()
    assert empty.status == "fail" and empty.max_rel is None and "no RMSE" in empty.note
    assert ex.compare({"e": 0.0}, {"e": 0.0}) == {"e": 0.0}


def test_table_one_line_per_quantity_verdict_on_the_first():
    row = ex.Row("water/x.json", system="data_3", mdtrain={"energy": 1.0, "force": 2.0},
                 deepmd={"energy": 1.0, "virial": 3.0}, wall_s=12.3)  # fmt: skip
    row.judge()
    lines = ex.format_table([row, ex.Row("bad.json", note="train failed (rc 1): boom")])
    lines = lines.splitlines()
    assert len(lines) == 2 + 3 + 1 + 1  # header, rule, 3 quantities, the failed row and its note
    assert "water/x.json" in lines[2] and "pass" in lines[2] and lines[2].rstrip().endswith("12")
    assert "force" in lines[3] and "-" in lines[3].split()[-1] and "pass" not in lines[3]
    assert "bad.json" in lines[5] and "fail" in lines[5]
    assert "note: train failed (rc 1): boom" in lines[6]


def test_inputs_paths_short_run_and_systems(tmp_path):
    ex_dir = tmp_path / "examples" / "water" / "a"
    data = tmp_path / "examples" / "water" / "data"
    for name in ("data_0", "data_1"):
        (data / name / "set.000").mkdir(parents=True)
        (data / name / "type.raw").write_text("0\n")
    ex_dir.mkdir(parents=True)
    (ex_dir / "table.txt").write_text("0 0\n")
    config = {
        "model": {"type_map": ["table.txt"], "use_srtab": "table.txt",
                  "fitting_net": {"precision": "float32"}},
        "training": {"training_data": {"systems": ["../data/data_0"]},
                     "validation_data": {"systems": "../data/"},
                     "numb_steps": 1000, "stop_batch": 5, "disp_freq": 100, "save_freq": 500,
                     "disp_file": "lcurve.out"},
    }  # fmt: skip
    (ex_dir / "input.json").write_text(json.dumps(config))
    (ex_dir / "notes.json").write_text(json.dumps({"model": {}}))
    (ex_dir / "list.json").write_text("[1, 2]")
    assert ex.training_inputs(tmp_path / "examples") == [ex_dir / "input.json"]
    out = ex.short_run(ex.absolutise(config, ex_dir), 3)
    assert out["model"]["type_map"] == ["table.txt"]  # element names are never paths
    assert out["model"]["use_srtab"] == str((ex_dir / "table.txt").resolve())
    assert out["training"]["training_data"]["systems"] == [str((data / "data_0").resolve())]
    assert out["training"]["disp_file"] == "lcurve.out"  # not there: an output, left as is
    t = out["training"]
    assert (t["numb_steps"], t["disp_freq"], t["save_freq"], "stop_batch" in t) == (3, 3, 3, False)
    found = ex.systems_of(t["validation_data"]["systems"])
    assert [p.name for p in found] == ["data_0", "data_1"]
    assert ex.model_precision(out) == "float32" and ex.model_precision({"model": {}}) == "float64"
    (data / "data_0" / "set.000" / "atomic_dipole.npy").write_bytes(b"")
    assert ex.dp_atomic(data / "data_0") and not ex.dp_atomic(data / "data_1")
    (data / "data_0" / "set.000" / "dipole.npy").write_bytes(b"")
    assert not ex.dp_atomic(data / "data_0")


def test_atomic_only_dos_is_skipped_for_dp(tmp_path):
    s = tmp_path / "atomic_system" / "set.000"
    s.mkdir(parents=True)
    for name in ("atom_dos.npy", "atom_ener.npy", "energy.npy"):
        (s / name).write_bytes(b"")
    assert ex.needs_global(s.parent)
    (s / "dos.npy").write_bytes(b"")
    assert not ex.needs_global(s.parent)  # atom_ener beside energy: not a reason
    (s / "atom_band.npy").write_bytes(b"")
    assert ex.needs_global(s.parent)
