"""Training batches: per-system batch sizes, system probabilities and a restorable sampler.

Rules (DeePMD-compatible):

- ``batch_size``: an int for all systems, a list (one per system), ``"auto"`` =
  ``ceil(32 / natoms)``, ``"auto:N"`` = ``ceil(N / natoms)``, ``"max:N"`` =
  ``max(1, N // natoms)``, ``"mixed:N"`` = N frames whatever the system, but at most the
  system's frames (DeePMD-kit draws N frames across systems into one padded batch; a batch
  here has one composition, and a composition of few frames must not fill a batch with
  copies: see docs/deepmd-differences.md); always at least 1. Under DDP this is the
  per-rank batch.
- A mixed-type system is opened as one system per composition (``System.source`` names the
  system they come from). A list (``batch_size``, ``sys_probs``) and the ``auto_prob`` rules
  count the systems of the input: a composition takes its system's batch size, and its
  system's probability is split between its compositions by their batches per epoch (so
  each frame is drawn as often as if the system were one).
- System probabilities: ``sys_probs`` (if given) wins over ``auto_prob``.
  ``"prob_uniform"``: equal; ``"prob_sys_size"``: proportional to the number of batches per
  epoch; ``"prob_sys_size;a:b:w;..."``: systems ``[a, b)`` share a total weight ``w``
  (weights normalised), split within the block by batch count, uncovered systems get 0.
  ``sys_probs`` list: negative entries share the mass left by the others by batch count.

`TrainingSampler` draws, every step, one system (a batch never mixes systems) from an RNG
that is identical on all ranks, then the next *global* batch of ``world_size * b`` frames from
that system's frame stream; rank ``r`` takes frames ``[r*b, (r+1)*b)`` of it. The stream of a
system is the concatenation of its per-epoch permutations, each seeded from (seed, system,
epoch), so it does not depend on the number of ranks: R ranks with batch b consume exactly the
frames 1 rank with batch R*b would, in the same order. A global batch that runs past the end of
an epoch continues into the next one, so every batch is full and every epoch visits every frame
exactly once.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mdtrain.errors import MDTrainError

if TYPE_CHECKING:
    from mdtrain.data import System
    from mdtrain.distributed import Runtime

_STATE_VERSION = 1


def source_index(sources: Sequence[str] | None, nsys: int) -> tuple[np.ndarray, int]:
    """For each system the index of its source (the input's system) in order of first
    appearance, and the number of sources; every system its own source when None."""
    if sources is None:
        return np.arange(nsys), nsys
    first: dict[str, int] = {}
    owner = np.array([first.setdefault(s, len(first)) for s in sources], dtype=np.int64)
    return owner, len(first)


def batch_sizes(
    spec: int | str | Sequence[int],
    natoms: Sequence[int],
    path: str = "training.training_data.batch_size",
    sources: Sequence[str] | None = None,
    nframes: Sequence[int] | None = None,
) -> list[int]:
    """Per-system batch sizes from the ``batch_size`` input value; ``path`` names it in errors.
    ``sources`` (one per system): a list gives one value per source (see the module doc);
    ``nframes`` (one per system) caps ``"mixed:N"``."""
    nsys = len(natoms)
    owner, nsources = source_index(sources, nsys)
    if isinstance(spec, bool):
        raise MDTrainError(f"{path}: expected an integer, a list or 'auto', got {spec!r}")
    if isinstance(spec, int):
        sizes = [spec] * nsys
    elif isinstance(spec, (list, tuple)):
        if len(spec) != nsources:
            raise MDTrainError(f"{path}: {len(spec)} values given for {nsources} systems")
        sizes = [spec[k] for k in owner.tolist()]
    elif isinstance(spec, str):
        rule, _, arg = spec.partition(":")
        if rule == "auto" and not arg:
            arg = "32"
        if rule not in ("auto", "max", "mixed") or not arg.isdigit() or int(arg) < 1:
            raise MDTrainError(
                f"{path}: unknown value {spec!r} (use an integer, a list, 'auto', 'auto:N', "
                "'max:N' or 'mixed:N')"
            )
        n = int(arg)
        if rule == "mixed":
            sizes = [n] * nsys if nframes is None else [max(1, min(n, f)) for f in nframes]
        elif rule == "auto":
            sizes = [max(1, math.ceil(n / na)) for na in natoms]
        else:
            sizes = [max(1, n // na) for na in natoms]
    else:
        raise MDTrainError(f"{path}: expected an integer, a list or 'auto', got {spec!r}")
    for i, b in enumerate(sizes):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise MDTrainError(f"{path}[{i}]: batch size must be an integer >= 1, got {b!r}")
    return sizes


def batches_per_epoch(
    nframes: Sequence[int], batch_sizes: Sequence[int], world_size: int = 1
) -> list[int]:
    """Global batches per epoch of each system: ``ceil(nframes / (world_size * b))``."""
    return [math.ceil(n / (world_size * b)) for n, b in zip(nframes, batch_sizes, strict=True)]


def system_probs(
    nbatches: Sequence[int],
    sys_probs: Sequence[float] | None = None,
    auto_prob: str = "prob_sys_size",
    path: str = "training.training_data",
    sources: Sequence[str] | None = None,
) -> np.ndarray:
    """Probability of drawing each system per step (float64, sums to 1). ``sources`` (one
    per system): the probabilities are those of the sources, each split between its systems
    by their batches per epoch (see the module doc)."""
    nb = np.asarray(nbatches, dtype=np.float64)
    owner, nsources = source_index(sources, len(nb))
    if nsources < len(nb):
        per_source = np.bincount(owner, weights=nb, minlength=nsources)
        probs = system_probs(per_source, sys_probs, auto_prob, path)
        return probs[owner] * nb / per_source[owner]
    nsys = len(nb)
    if nsys == 0:
        raise MDTrainError(f"{path}: no systems")
    if sys_probs is not None:
        probs = _explicit_probs(nb, sys_probs, f"{path}.sys_probs")
    elif auto_prob == "prob_uniform":
        probs = np.full(nsys, 1.0 / nsys)
    elif auto_prob == "prob_sys_size":
        probs = nb / nb.sum()
    elif auto_prob.startswith("prob_sys_size;"):
        probs = _block_probs(nb, auto_prob, f"{path}.auto_prob")
    else:
        raise MDTrainError(
            f"{path}.auto_prob: unknown value {auto_prob!r} (use 'prob_uniform', "
            "'prob_sys_size' or 'prob_sys_size;a:b:w;...')"
        )
    return probs / probs.sum()


def _explicit_probs(nb: np.ndarray, sys_probs: Sequence[float], path: str) -> np.ndarray:
    given = np.asarray(sys_probs, dtype=np.float64)
    if given.shape != nb.shape:
        raise MDTrainError(f"{path}: {given.size} values given for {nb.size} systems")
    assigned = given >= 0
    mass = given[assigned].sum()
    if mass > 1 + 1e-8:
        raise MDTrainError(f"{path}: the non-negative entries sum to {mass:g} > 1")
    if assigned.all():
        if abs(mass - 1) > 1e-8:
            raise MDTrainError(f"{path}: the probabilities sum to {mass:g}, not 1")
        return given
    rest = np.where(assigned, 0.0, nb)
    return np.where(assigned, given, (1 - mass) * rest / rest.sum())


def _block_probs(nb: np.ndarray, spec: str, path: str) -> np.ndarray:
    probs = np.zeros_like(nb)
    covered = np.zeros(nb.size, dtype=bool)
    blocks = []
    for part in spec.split(";")[1:]:
        try:
            a, b, w = part.split(":")
            a, b, w = int(a), int(b), float(w)
        except ValueError:
            raise MDTrainError(f"{path}: block {part!r} is not 'start:end:weight'") from None
        if not 0 <= a < b <= nb.size or w < 0:
            raise MDTrainError(
                f"{path}: block {part!r} needs 0 <= start < end <= {nb.size} and weight >= 0"
            )
        if covered[a:b].any():
            raise MDTrainError(f"{path}: block {part!r} overlaps an earlier block")
        covered[a:b] = True
        blocks.append((a, b, w))
    total = sum(w for _, _, w in blocks)
    if not blocks or total <= 0:
        raise MDTrainError(f"{path}: no block with a positive weight in {spec!r}")
    for a, b, w in blocks:
        probs[a:b] = w / total * nb[a:b] / nb[a:b].sum()
    return probs


class TrainingSampler:
    """Infinite stream of ``(system index, frame indices)`` for this rank; see module doc."""

    def __init__(
        self,
        nframes_per_system: Sequence[int],
        batch_sizes: Sequence[int],
        probs: Sequence[float],
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        nsys = len(nframes_per_system)
        if not (len(batch_sizes) == len(probs) == nsys) or nsys == 0:
            raise ValueError("nframes_per_system, batch_sizes and probs must have equal length")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        p = np.asarray(probs, dtype=np.float64)
        if (p < 0).any() or not p.sum() > 0:
            raise ValueError(f"invalid system probabilities {list(p)}")
        for i, n in enumerate(nframes_per_system):
            if p[i] > 0 and n < 1:
                raise ValueError(f"system {i} has no frames but probability {p[i]}")
        self.nframes = [int(n) for n in nframes_per_system]
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.probs = p / p.sum()
        # ``Generator.choice(n, p=probs)``'s own cumulative sums, for `next_batch`'s draw
        cdf = self.probs.cumsum()
        cdf /= cdf[-1]
        self._cdf = cdf.tolist()
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0])))
        self._epoch = [0] * nsys
        self._pos = [0] * nsys
        self._perm: list[np.ndarray | None] = [None] * nsys

    def _permutation(self, system: int) -> np.ndarray:
        perm = self._perm[system]
        if perm is None:
            ss = np.random.SeedSequence([self.seed, 1, system, self._epoch[system]])
            perm = np.random.Generator(np.random.PCG64(ss)).permutation(self.nframes[system])
            self._perm[system] = perm
        return perm

    def _take(self, system: int, count: int) -> np.ndarray:
        """Next ``count`` frames of the system's stream, crossing epochs as needed."""
        out = []
        while count > 0:
            perm = self._permutation(system)
            pos = self._pos[system]
            chunk = perm[pos : pos + count]
            out.append(chunk)
            count -= len(chunk)
            self._pos[system] = pos + len(chunk)
            if self._pos[system] == len(perm):
                self._epoch[system] += 1
                self._pos[system] = 0
                self._perm[system] = None
        return np.concatenate(out).astype(np.int64)

    def next_batch(self, scale: int = 1) -> tuple[int, np.ndarray]:
        """Draw the next step's system and this rank's frame indices (int64, in stream order).

        ``scale`` multiplies the system's batch size (the batch controller's ``grow`` option).
        """
        # what ``self._rng.choice(len(self.probs), p=self.probs)`` draws (one uniform
        # number, searched in the cumulative sums from the right), without its 20 µs of
        # argument checks: the same systems from the same random stream
        system = bisect.bisect_right(self._cdf, self._rng.random())
        b = self.batch_sizes[system] * scale
        frames = self._take(system, self.world_size * b)
        self.step += 1
        return system, frames[self.rank * b : (self.rank + 1) * b]

    def peek(self, count: int, scale: int = 1) -> list[tuple[int, np.ndarray]]:
        """The next ``count`` draws of `next_batch` (at ``scale``), this sampler unchanged:
        they are drawn from a copy (`copy_ahead`)."""
        ahead = self.copy_ahead()
        return [ahead.next_batch(scale) for _ in range(count)]

    def copy_ahead(self) -> TrainingSampler:
        """A copy that draws what this sampler draws next, this one unchanged (the
        permutations, never modified, are shared)."""
        ahead = copy.copy(self)
        ahead._rng = copy.deepcopy(self._rng)
        ahead._epoch, ahead._pos, ahead._perm = list(self._epoch), list(self._pos), list(self._perm)
        return ahead

    def __iter__(self) -> TrainingSampler:
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        return self.next_batch()

    def epochs(self) -> list[float]:
        """Fraction of epochs done per system (for logging)."""
        return [
            e + p / n if n else 0.0
            for e, p, n in zip(self._epoch, self._pos, self.nframes, strict=True)
        ]

    def state_dict(self) -> dict:
        """Plain ints/lists/dicts (JSON-able, ``torch.load(weights_only=True)``-loadable)."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "step": self.step,
            "nframes": list(self.nframes),
            "epoch": list(self._epoch),
            "pos": list(self._pos),
            "rng": _plain(self._rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state_dict` left off (the stored seed wins).

        Positions are in units of the global frame stream, so a restart may change the number
        of ranks and per-rank batch size; it must not change the systems or their frames.
        """
        if state.get("version") != _STATE_VERSION:
            raise MDTrainError(f"sampler state version {state.get('version')} is not supported")
        if list(state["nframes"]) != self.nframes:
            raise MDTrainError(
                "the training systems changed since the checkpoint was written (frames per "
                f"system {list(state['nframes'])} then, {self.nframes} now)"
            )
        self.seed = int(state["seed"])
        self.step = int(state["step"])
        self._epoch = [int(e) for e in state["epoch"]]
        self._pos = [int(p) for p in state["pos"]]
        self._perm = [None] * len(self.nframes)
        self._rng.bit_generator.state = state["rng"]


def _plain(obj):
    """Deep copy with numpy scalars turned into Python ints/floats."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def make_sampler(
    systems: list[System], data_cfg: dict, seed: int, rt: Runtime | int, section: str
) -> TrainingSampler:
    """The sampler of one data section; ``rt`` a runtime or a world size (for checks only)."""
    rank, world = (0, rt) if isinstance(rt, int) else (rt.rank, rt.world_size)
    natoms = [s.natoms for s in systems]
    nframes = [s.nframes for s in systems]
    sources = [s.source for s in systems]  # a mixed-type system gives several
    spec = data_cfg["batch_size"]
    sizes = batch_sizes(spec, natoms, f"training.{section}.batch_size", sources, nframes)
    nbatch = batches_per_epoch(nframes, sizes, world)
    probs = system_probs(
        nbatch, data_cfg.get("sys_probs"), data_cfg.get("auto_prob", "prob_sys_size"),
        f"training.{section}", sources,
    )  # fmt: skip
    return TrainingSampler(nframes, sizes, probs, seed, rank, world)
