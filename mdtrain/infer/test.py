"""Testing a model: RMSE and MAE of its energies, forces and virials on systems (for
``mdtrain test``).

Per system the first N frames are evaluated in memory-adaptive chunks. The total over all
systems pools the squared and absolute errors (weighted by frames for energies and virials,
by force components for forces), never averages of per-system RMSEs, so it equals the
figure of one system holding all the frames.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from mdtrain.data import System
from mdtrain.data.params import ParamSpec
from mdtrain.errors import MDTrainError
from mdtrain.infer.finite import check_predictions
from mdtrain.memory import InferenceChunker

log = logging.getLogger("mdtrain.test")

# error name -> (label it needs, unit); JSON keys from `figure_key`
QUANTITIES: dict[str, tuple[str, str]] = {
    "energy": ("energy", "eV"),
    "energy_per_atom": ("energy", "eV/atom"),
    "force": ("force", "eV/Å"),
    "virial": ("virial", "eV"),
    "virial_per_atom": ("virial", "eV/atom"),
    # dipole and polar models: in the labels' own unit
    "dipole": ("dipole", "label unit"),
    "atomic_dipole": ("atomic_dipole", "label unit"),
    "polarizability": ("polarizability", "label unit"),
    "atomic_polarizability": ("atomic_polarizability", "label unit"),
    # DOS and property models (DeePMD-kit's dp test: DOS, DOS/Natoms, atomic DOS; PROPERTY,
    # atomic PROPERTY), the property's label files named by its property_name
    "dos": ("dos", "label unit"),
    "dos_per_atom": ("dos", "label unit/atom"),
    "atom_dos": ("atom_dos", "label unit"),
    "property": ("property", "label unit"),
    "atom_property": ("atom_property", "label unit"),
}
TENSOR_QUANTITIES = ("dipole", "atomic_dipole", "polarizability", "atomic_polarizability")
OUTPUT_QUANTITIES = ("atom_dos", "property", "atom_property")  # compared as they are
PARITY_MAX_POINTS = 200_000  # force components drawn at most (a random subset beyond)


def figure_key(name: str, stat: str) -> str:
    """``energy``/``rmse`` → ``energy_rmse``; ``energy_per_atom``/``rmse`` → ``energy_rmse_per_atom``."""
    base, per_atom, _ = name.partition("_per_atom")
    return f"{base}_{stat}{per_atom}"


@dataclass
class ErrorSums:
    """Sums of squared and absolute errors and their counts, per quantity; mergeable."""

    nframes: int = 0
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [sum sq, sum abs, n]

    def add(self, name: str, err: np.ndarray) -> None:
        err = np.asarray(err, dtype=np.float64)
        row = np.array([np.square(err).sum(), np.abs(err).sum(), err.size], dtype=np.float64)
        self.sums[name] = self.sums.get(name, np.zeros(3)) + row

    def merge(self, other: ErrorSums) -> None:
        self.nframes += other.nframes
        for name, row in other.sums.items():
            self.sums[name] = self.sums.get(name, np.zeros(3)) + row

    def rmse(self, name: str) -> float:
        sq, _, n = self.sums[name]
        return float(np.sqrt(sq / n))

    def mae(self, name: str) -> float:
        _, ab, n = self.sums[name]
        return float(ab / n)

    def summary(self) -> dict:
        """``nframes`` and the RMSE/MAE (`figure_key` names) of every quantity with data."""
        out: dict = {"nframes": self.nframes}
        for name in QUANTITIES:
            if name in self.sums and self.sums[name][2] > 0:
                out[figure_key(name, "rmse")] = self.rmse(name)
                out[figure_key(name, "mae")] = self.mae(name)
        return out


@dataclass
class SystemResult:
    """Predictions and labels (float64 numpy) of the frames tested in one system."""

    path: str
    natoms: int
    pred: dict[str, np.ndarray]
    label: dict[str, np.ndarray]

    @property
    def nframes(self) -> int:
        return len(next(iter(self.pred.values())))

    def errors(self) -> ErrorSums:
        sums = ErrorSums(nframes=self.nframes)
        if "energy" in self.label:
            de = self.pred["energy"] - self.label["energy"]
            sums.add("energy", de)
            sums.add("energy_per_atom", de / self.natoms)
        if "force" in self.label:
            sums.add("force", self.pred["force"] - self.label["force"])
        if "virial" in self.label:
            dv = self.pred["virial"] - self.label["virial"]
            sums.add("virial", dv)
            sums.add("virial_per_atom", dv / self.natoms)
        for name in (*TENSOR_QUANTITIES, *OUTPUT_QUANTITIES):
            if name in self.label:
                sums.add(name, self.pred[name] - self.label[name])
        if "dos" in self.label:
            diff = self.pred["dos"] - self.label["dos"]
            sums.add("dos", diff)
            sums.add("dos_per_atom", diff / self.natoms)
        return sums


def prediction_names(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """What ``mdtrain test`` compares for ``model``: prediction name -> (the model output
    giving it, the label file it is compared with)."""
    tensor = getattr(model, "label", None)  # "dipole" or "polarizability" for those models
    if tensor:
        return {
            tensor: (tensor, tensor),
            f"atomic_{tensor}": (f"atom_{tensor}", f"atomic_{tensor}"),
        }
    own = getattr(model, "output", None)  # "dos" or the property_name
    if own:
        name = "dos" if own == "dos" else "property"
        return {name: (own, own), f"atom_{name}": (f"atom_{own}", f"atom_{own}")}
    return {k: (k, k) for k in ("energy", "force", "virial")}


def evaluate_system(
    model: torch.nn.Module,
    system: System,
    nframes: int,
    device: torch.device | str = "cpu",
    chunker=None,
    on_frames=None,
    name: str = "the model",
) -> SystemResult:
    """Predictions for the first ``nframes`` frames of ``system``, in OOM-adaptive chunks.

    ``on_frames(n)`` is called after each chunk (progress); ``chunker`` is an
    ``InferenceChunker`` whose learned size carries over between systems.
    """
    from mdtrain.batching import make_batch
    from mdtrain.neighbors.layout import layout_of

    chunker = chunker or InferenceChunker(device=device)
    rcut, sel = float(model.rcut), [int(s) for s in model.sel]
    params = ParamSpec.of_model(model)
    layout = layout_of(model)
    names = prediction_names(model)
    outputs = {k: output for k, (output, _) in names.items()}
    labels = [k for k, (_, file) in names.items() if system.has(file)]
    tensor = getattr(model, "label", None)
    tensor_keep = model.atom_keep.cpu().numpy() if tensor else None
    if not system.periodic and "virial" in labels:
        labels.remove("virial")  # a virial without a cell is not comparable

    def run(start: int, stop: int) -> dict[str, np.ndarray]:
        batch = make_batch(
            system, np.arange(start, stop), rcut, sel, device, layout=layout, params=params
        )
        with torch.enable_grad():  # forces are derivatives (TorchScript cannot enable it)
            out = model(*batch.inputs())
        result = {k: out[o].detach().cpu().numpy() for k, o in outputs.items()}
        check_predictions(result, name, system.path, start)
        for k in labels:
            result["label_" + k] = batch.labels[names[k][1]].cpu().numpy()
        if tensor_keep is not None:  # atomic tensors: the selected atoms only, as dp test
            keep = tensor_keep[batch.atype.cpu().numpy()] > 0
            for k in [k for k in result if k.endswith(f"atomic_{tensor}")]:
                result[k] = result[k][:, keep]
        if on_frames is not None:
            on_frames(stop - start)
        return result

    chunks = chunker.run_all(run, nframes, system.natoms, name=system.path)
    joined = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    return SystemResult(
        path=system.path,
        natoms=system.natoms,
        pred={k: joined[k] for k in outputs},
        label={k: joined["label_" + k] for k in labels},
    )


def format_table(title: str, summary: dict) -> str:
    """A plain-text table of one summary (as from `ErrorSums.summary`)."""
    lines = [title, f"  {'quantity':<16}{'RMSE':>14}{'MAE':>14}  unit"]
    for name, (_, unit) in QUANTITIES.items():
        if figure_key(name, "rmse") in summary:
            rmse, mae = summary[figure_key(name, "rmse")], summary[figure_key(name, "mae")]
            lines.append(
                f"  {name.replace('_per_atom', '/atom'):<16}{rmse:>14.6e}{mae:>14.6e}  {unit}"
            )
    if len(lines) == 2:
        lines.append("  (no labels of the model's outputs)")
    return "\n".join(lines)


def draw_parity(results: list[SystemResult], path: str, seed: int = 0) -> None:
    """Predicted-vs-reference scatter plots: energy/atom, force components, virial/atom; for
    a dipole or polar model the components of its frame and atomic tensors (the atoms of
    sel_type); for a DOS or property model its frame and atomic values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("energy", "energy per atom (eV/atom)", True),
        ("force", "force components (eV/Å)", False),
        ("virial", "virial per atom (eV/atom)", True),
        # dipole and polar models: every component of every frame (and selected atom)
        ("dipole", "dipole components", False),
        ("atomic_dipole", "atomic dipole components", False),
        ("polarizability", "polarizability components", False),
        ("atomic_polarizability", "atomic polarizability components", False),
        # DOS and property models: every value of every frame (and atom)
        ("dos", "DOS values", False),
        ("atom_dos", "atomic DOS values", False),
        ("property", "property values", False),
        ("atom_property", "atomic property values", False),
    ]
    panels = [p for p in panels if any(p[0] in r.label for r in results)]
    if not panels:
        raise MDTrainError(f"--parity {path}: the systems have no labels of the model's outputs")
    rng = np.random.default_rng(seed)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.4), squeeze=False)
    legend = len(results) <= 8
    for ax, (key, title, per_atom) in zip(axes[0], panels):
        lo, hi = np.inf, -np.inf
        npoints = sum(r.label[key].size for r in results if key in r.label)
        keep = min(1.0, PARITY_MAX_POINTS / max(npoints, 1))
        for r in results:
            if key not in r.label:
                continue
            ref, pred = r.label[key].ravel(), r.pred[key].ravel()
            if per_atom:
                ref, pred = ref / r.natoms, pred / r.natoms
            if keep < 1.0:
                pick = rng.random(ref.size) < keep
                ref, pred = ref[pick], pred[pick]
            if ref.size == 0:
                continue
            ax.scatter(
                ref, pred, s=4, alpha=0.6, label=os.path.basename(r.path.rstrip("/")) or r.path
            )
            lo, hi = min(lo, ref.min(), pred.min()), max(hi, ref.max(), pred.max())
        if np.isfinite(lo):
            pad = 0.05 * (hi - lo or 1.0)
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=0.8)
        sums = ErrorSums()
        for r in results:
            sums.merge(r.errors())
        name = f"{key}_per_atom" if per_atom else key
        ax.text(
            0.97,
            0.03,
            f"RMSE {sums.rmse(name):.3g}",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
        )
        ax.set_title(title)
        ax.set_xlabel("reference")
        ax.set_ylabel("predicted")
        if legend and len(results) > 1:
            ax.legend(fontsize=7, markerscale=2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise MDTrainError(f"--parity {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    log.info("wrote %s", path)
