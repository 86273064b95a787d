#!/usr/bin/env bash
# One round of active learning on the water example: a committee of 4 models trained in one
# job, a short MD trajectory run with member 0 through the ASE calculator, and the committee's
# model deviation along it (DeePMD-kit's model_devi.out). Outputs go to examples/water/out/active/
# (or $1); see docs/active-learning.md for how the deviations select new DFT frames.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/out/active}"
mkdir -p "$out"
cd "$here"
mdtrain train input.json --ensemble 4 -o "$out/committee"
python - "$out" <<'PY'
import sys

import numpy as np
from ase import Atoms, units
from ase.io import write
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet

from mdtrain.calculator import MDTrainCalculator

out = sys.argv[1]
system = "data/valid/w32"
names = open(f"{system}/type_map.raw").read().split()
symbols = [names[int(t)] for t in open(f"{system}/type.raw").read().split()]
coord = np.load(f"{system}/set.000/coord.npy")[0].reshape(-1, 3)
box = np.load(f"{system}/set.000/box.npy")[0].reshape(3, 3)
atoms = Atoms(symbols, positions=coord, cell=box, pbc=True)
atoms.calc = MDTrainCalculator(f"{out}/committee/member-0/model.ckpt.pt")
MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
frames = []
dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
dyn.attach(lambda: frames.append(atoms.copy()), interval=5)
dyn.run(50)
write(f"{out}/md.extxyz", frames)
print(f"wrote {len(frames)} frames to {out}/md.extxyz")
PY
mdtrain model-devi -m "$out/committee" -s "$out/md.extxyz" -o "$out/model_devi.out"
echo "done: committee in $out/committee/member-*, deviations in $out/model_devi.out"
