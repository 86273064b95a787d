#!/usr/bin/env bash
# The water example end to end: check, neighbour statistics, training, test, freeze (mdtrain's
# TorchScript model.pth and DeePMD-kit's model.dp), plot.
# Runs in a few minutes on two cores; outputs go to examples/water/out/ (or $1).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/out}"
mkdir -p "$out"
cd "$here"
mdtrain check input.json
mdtrain neighbor-stat input.json -o "$out/neighbor_stat.json"
mdtrain train input.json -o "$out" --neighbor-stat-file "$out/neighbor_stat.json"
mdtrain freeze "$out/model.ckpt.pt" -o "$out/model.pth"
mdtrain freeze "$out/model.ckpt.pt" -o "$out/model.dp"
mdtrain test -m "$out/model.pth" -s data/valid --json "$out/test.json" --parity "$out/parity.png"
mdtrain plot "$out/lcurve.out" -o "$out/lcurve.png"
echo "done: results in $out (lcurve.png, parity.png, test.json, model.pth, model.dp)"
