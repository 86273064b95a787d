"""Small models and random frames for the tests: configurations, models with non-trivial
statistics, water-like frames, one-frame evaluation, batches of model inputs, and a tiny
checkpoint."""

from __future__ import annotations

import copy

import numpy as np
import torch

from mdtrain.model import EnergyModel
from mdtrain.neighbors.layout import PER_TYPE, layout_of

BASE = {
    "type_map": ["O", "H"],
    "descriptor": {
        "type": "se_e2_a",
        "sel": [12, 24],
        "rcut": 3.5,
        "rcut_smth": 0.5,
        "neuron": [4, 8, 16],
        "axis_neuron": 4,
        "type_one_side": True,
        "resnet_dt": True,
        "seed": 1,
    },
    "fitting_net": {"neuron": [16, 16], "resnet_dt": True, "seed": 2},
}


def small_config(descriptor: dict | None = None, fitting: dict | None = None, **model) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg["descriptor"].update(descriptor or {})
    cfg["fitting_net"].update(fitting or {})
    cfg.update(model)
    return cfg


def set_random_stats(model: EnergyModel, seed: int = 0) -> EnergyModel:
    """Non-trivial davg/dstd (tiled per centre type, angular mean 0, as statistics give) and bias."""
    rng = np.random.default_rng(seed)
    random_env_stats(model.descriptor, rng, model.descriptor.set_davg_zero)
    model.set_out_bias(rng.uniform(-3, -1, size=model.descriptor.ntypes))
    return model


_ATTEN = {"sel": 40, "rcut": 3.5, "rcut_smth": 0.5, "neuron": [4, 8], "axis_neuron": 2}
_ATTEN |= {"tebd_dim": 3, "attn": 6, "attn_layer": 1, "seed": 1}
# descriptor sections of the tensor models the tests run (None: se_e2_a of `BASE`): those
# with a rotation matrix, type-mixed ones (one fitting net for all types) included
TENSOR_DESCRIPTORS: dict[str, dict | None] = {
    "se_e2_a": None,
    "se_atten": {"type": "se_atten", **_ATTEN},
    "se_atten_v2": {"type": "se_atten_v2", **_ATTEN, "attn_layer": 2},
    "hybrid-mixed": {
        "type": "hybrid",
        "list": [
            {"type": "se_e2_a", "sel": [6, 12], "rcut": 3.0, "rcut_smth": 0.5, "neuron": [4, 6]},
            {"type": "dpa1", **_ATTEN, "tebd_input_mode": "strip"},
        ],
    },
}


def make_tensor_model(kind: str, seed: int = 0, descriptor: str = "se_e2_a", **fitting):
    """A small dipole or polar `TensorModel` (descriptor: a key of `TENSOR_DESCRIPTORS`)
    with random statistics, random ``bias_atom_e`` and, for polar, random
    ``constant_matrix`` and ``out_bias``."""
    from mdtrain.model.tensor import TensorModel

    cfg = small_config(fitting={"type": kind, "neuron": [16, 16], "seed": 2, **fitting})
    cfg["fitting_net"].pop("resnet_dt")
    if TENSOR_DESCRIPTORS[descriptor] is not None:
        cfg["descriptor"] = copy.deepcopy(TENSOR_DESCRIPTORS[descriptor])
    model = TensorModel(cfg)
    rng = np.random.default_rng(seed)
    random_env_stats(model.descriptor, rng)
    with torch.no_grad():
        bias = model.fitting.nets.bias_atom_e
        bias.copy_(torch.from_numpy(rng.normal(0, 0.3, size=tuple(bias.shape))))
        if kind == "polar":
            model.fitting.constant_matrix.copy_(torch.from_numpy(rng.normal(size=2)))
            model.out_bias.copy_(torch.from_numpy(rng.normal(size=(2, 9))))
    return model


DPA1 = {"type": "dpa1", "sel": 40, "neuron": [4, 8], "tebd_dim": 3, "attn_layer": 1, "attn": 8}
INVARIANT_CASES = {
    "dos": ({"type": "dos", "numb_dos": 5}, None),
    "property": ({"type": "property", "property_name": "gap", "task_dim": 2}, None),
    "intensive": ({"type": "property", "property_name": "gap", "intensive": True}, None),
    "property-dpa1": ({"type": "property", "property_name": "gap", "task_dim": 3}, DPA1),
}


def make_invariant_model(case: str, seed: int = 0, **model):
    """A small DOS or property `InvariantModel` (``INVARIANT_CASES``) with random
    statistics, ``bias_atom_e``, ``out_bias`` and ``out_std``."""
    from mdtrain.model.invariant import InvariantModel

    fit, desc = INVARIANT_CASES[case]
    cfg = small_config(descriptor=desc, fitting={"neuron": [16, 16], "seed": 2, **fit}, **model)
    cfg["fitting_net"].pop("resnet_dt")
    if desc is not None:
        cfg["descriptor"] = {"rcut": 3.5, "rcut_smth": 0.5, "seed": 1, **desc}
    m = InvariantModel(cfg)
    rng = np.random.default_rng(seed)
    if not m.descriptor.mixed_types:
        random_env_stats(m.descriptor, rng)
    with torch.no_grad():
        for buffer, scale in ((m.fitting.bias_atom_e, 0.3), (m.out_bias, 1.0)):
            buffer.copy_(torch.from_numpy(rng.normal(0, scale, size=tuple(buffer.shape))))
        m.out_std.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, size=tuple(m.out_std.shape))))
    return m


def random_env_stats(desc, rng: np.random.Generator, davg_zero: bool = False) -> None:
    """Install random davg/dstd shaped as the descriptor's statistics give them: per centre
    type, a mean for the first group only (the radial column), a std per group; a
    hybrid's members each in turn."""
    if hasattr(desc, "members"):
        for member in desc.members:
            random_env_stats(member, rng, member.set_davg_zero)
        return
    davg = np.zeros((desc.ntypes, desc.nnei, desc.ncols))
    dstd = np.ones((desc.ntypes, desc.nnei, desc.ncols))
    for t in range(desc.ntypes):
        for g, (a, b) in enumerate(desc.stat_columns):
            if g == 0:
                if not davg_zero:
                    davg[t, :, a:b] = rng.uniform(0.05, 0.3)
                dstd[t, :, a:b] = rng.uniform(0.1, 0.4)
            else:
                dstd[t, :, a:b] = rng.uniform(0.05, 0.2)
    desc.set_stats(torch.from_numpy(davg), torch.from_numpy(dstd))


def make_model(descriptor: dict | None = None, fitting: dict | None = None, **kw) -> EnergyModel:
    return set_random_stats(EnergyModel(small_config(descriptor, fitting, **kw)))


def water_like(nmol: int, box: np.ndarray | None, seed: int = 0, min_dist: float = 1.4):
    """Random non-overlapping H2O-like molecules; atoms sorted O first, then H."""
    rng = np.random.default_rng(seed)
    span = np.diag([4.0, 4.0, 4.0]) if box is None else box
    centres: list[np.ndarray] = []
    while len(centres) < nmol:
        c = rng.random(3) @ span
        ok = True
        for other in centres:
            d = c - other
            if box is not None:
                frac = np.linalg.solve(box.T, d)
                d = (frac - np.round(frac)) @ box
            if np.linalg.norm(d) < 2.2:
                ok = False
                break
        if ok:
            centres.append(c)
    o = np.array(centres)
    h = []
    for c in o:
        u, v = rng.normal(size=3), rng.normal(size=3)
        u /= np.linalg.norm(u)
        v -= u * (u @ v)
        v /= np.linalg.norm(v)
        ang = np.deg2rad(104.5)
        h.append(c + 0.96 * u)
        h.append(c + 0.96 * (np.cos(ang) * u + np.sin(ang) * v))
    coord = np.concatenate([o, np.array(h)])
    atype = np.array([0] * nmol + [1] * (2 * nmol), dtype=np.int64)
    return coord, atype


def triclinic(a: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.diag([a, a * 1.05, a * 0.95]) + np.triu(rng.uniform(-0.3, 0.3, (3, 3)) * a, 1)


def evaluate(model, coord, box, atype, sel=None, rcut=None) -> dict[str, np.ndarray]:
    """One frame through the model with a freshly built neighbour list; numpy outputs."""
    sel = list(model.sel) if sel is None else sel
    rcut = float(model.rcut) if rcut is None else rcut
    nlist, shift, _ = layout_of(model).build(coord, box, atype, rcut, sel)
    out = model(
        torch.tensor(coord)[None],
        torch.tensor(atype),
        None if box is None else torch.tensor(box)[None],
        torch.tensor(nlist)[None],
        torch.tensor(shift)[None],
    )
    return {k: v.detach()[0].numpy() for k, v in out.items()}


def energy_of(model, coord, box, atype) -> float:
    return float(evaluate(model, coord, box, atype)["energy"])


def strained(coord, box, eps):
    """Apply r' = r (I + eps) to coordinates and cell."""
    m = np.eye(3) + eps
    return coord @ m, None if box is None else box @ m


def batch(model: EnergyModel, periodic: bool = True, nmol: int = 3, lone_atom: bool = False):
    """Two frames of one system as model inputs; optionally an atom far from all others."""
    box = triclinic(5.0, seed=9) if periodic else None
    frames, atype = [], None
    for seed in (9, 10):
        coord, atype = water_like(nmol, box, seed=seed)
        if lone_atom:  # no neighbour within rcut (non-periodic frames only)
            coord = np.concatenate([coord[:1] + 50.0, coord[1:]])
        frames.append(coord)
    lists = [layout_of(model).build(c, box, atype, model.rcut, model.sel) for c in frames]
    return (
        torch.tensor(np.stack(frames)),
        torch.tensor(atype),
        None if box is None else torch.tensor(np.stack([box, box])),
        torch.tensor(np.stack([nl for nl, _, _ in lists])),
        torch.tensor(np.stack([sh for _, sh, _ in lists])),
    )


def water_batch(
    rcut: float, sel: list[int], nframes: int, nmol: int, edge: float, periodic: bool, seed: int
) -> tuple:
    """``nframes`` frames of ``nmol`` water-like molecules in a triclinic cell of ``edge``
    (atoms sorted O first; no cell when not ``periodic``) with their neighbour lists, as
    model inputs."""
    from tests.helpers.datagen import random_water_like

    coords, types, boxes = random_water_like(nframes, nmol, edge, seed=seed, triclinic=True)
    order = np.argsort(types, kind="stable")
    coords, atype = coords[:, order], types[order]
    box = boxes if periodic else None
    lists = [
        PER_TYPE.build(c, b if periodic else None, atype, rcut, sel) for c, b in zip(coords, boxes)
    ]
    return (
        torch.tensor(coords),
        torch.tensor(atype),
        None if box is None else torch.tensor(box),
        torch.tensor(np.stack([nl for nl, _, _ in lists])),
        torch.tensor(np.stack([sh for _, sh, _ in lists])),
    )


TINY_CONFIG = {
    "type_map": ["O", "H"],
    "descriptor": {
        "type": "se_e2_a",
        "sel": [16, 32],
        "rcut": 4.0,
        "rcut_smth": 0.5,
        "neuron": [4, 8, 16],
        "axis_neuron": 4,
        "seed": 1,
    },
    "fitting_net": {"neuron": [16, 16], "seed": 2},
}


def tiny_model(seed: int = 0, config: dict | None = None) -> EnergyModel:
    """An untrained float64 model with non-trivial statistics (so outputs are not flat)."""
    model = EnergyModel(config or TINY_CONFIG)
    rng = np.random.default_rng(seed)
    random_env_stats(model.descriptor, rng)
    model.set_out_bias(rng.uniform(-3, -1, size=model.descriptor.ntypes))
    return model.eval()


def save_tiny_checkpoint(path, model: EnergyModel | None = None) -> str:
    """A checkpoint in the documented format holding ``model`` (default `tiny_model()`)."""
    model = model or tiny_model()
    state = {
        "format": "mdtrain-checkpoint",
        "version": 1,
        "step": 0,
        "model_config": model.get_model_config(),
        "model_state": model.state_dict(),
    }
    torch.save(state, str(path))
    return str(path)
