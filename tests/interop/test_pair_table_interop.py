"""Combined models (DP+ZBL, linear_ener with a pair table) written by mdtrain as ``.dp``
files and evaluated by DeePMD-kit's numpy implementation part by part
(``deepmd_combined_eval.py``): the same atomic energies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdtrain.model.combined_build import build_combined_model
from mdtrain.model.deepmd_file import write_dp
from tests.helpers.models import evaluate, set_random_stats, small_config, triclinic, water_like
from tests.helpers.pair_tables import write_table, zbl_table

pytestmark = pytest.mark.interop
SCRIPT = Path(__file__).with_name("deepmd_combined_eval.py")


def models(table: Path):
    zbl = small_config(use_srtab=str(table), sw_rmin=0.8, sw_rmax=1.2, smin_alpha=0.15)
    yield "zbl", zbl
    net = small_config(descriptor={"rcut": 3.0, "sel": [10, 20]})
    pairtab = {"type": "pairtab", "tab_file": str(table), "rcut": 4.0, "sel": 60}
    yield "linear", {"type": "linear_ener", "type_map": ["O", "H"], "models": [net, pairtab],
                     "weights": [0.7, 1.3]}  # fmt: skip


@pytest.mark.parametrize("kind", ["zbl", "linear"])
def test_deepmd_evaluates_the_dp_file_to_mdtrains_energies(deepmd, tmp_path, kind):
    table = write_table(tmp_path / "zbl.txt", zbl_table(["O", "H"], 0.2, 4.0, 0.02, zero_from=3.6))
    config = dict(models(table))[kind]
    model = build_combined_model(config)
    set_random_stats(model.parts[0])
    model.set_out_bias([-1.1, -0.4])
    write_dp(model, tmp_path / "model.dp")
    box = triclinic(5.2, seed=11)
    frames = [water_like(3, box, seed=s) for s in (11, 12)]
    atype = frames[0][1]
    coords = np.stack([c for c, _ in frames])
    np.savez(tmp_path / "frames.npz", coord=coords, box=np.stack([box, box]), atype=atype)
    deepmd.run([deepmd.python, SCRIPT, "model.dp", "frames.npz", "out.npz"], tmp_path)
    theirs = np.load(tmp_path / "out.npz")["atom_energy"]
    ours = np.stack([evaluate(model, c, box, atype)["atom_energy"] for c in coords])
    print(f"{kind}: largest atomic energy difference {np.abs(ours - theirs).max():.2e} eV")
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)
