"""Device placement checked without a GPU: a second device that computes.

The ``meta`` device refuses any operation that mixes it with CPU tensors, but it holds no
values, so code that reads a number (``.item()``, boolean masks, sizes from ``nonzero``, the
optimiser) cannot run on it. ``OtherDevice`` gives the tensors it makes the device ``meta``
while keeping real CPU data behind them: every operation runs for real, and one whose
tensors lie on both devices raises ``PlacementError``, as CUDA would with a CPU tensor and a
GPU one. Tensors reach the other device only by being moved there (``.to(OTHER)``, ``copy_``)
or made there (``device=OTHER``, or from a tensor already there), exactly as on a GPU.

    with OtherDevice() as other:
        model = build_model(config, OTHER)          # parameters and buffers on OTHER
        out = model(*inputs_on_other)               # raises on any CPU tensor mixed in
        assert other.cpu_factories == []            # nothing made on the CPU meanwhile

Rules (CUDA's, a little stricter): a 0-dim CPU tensor (a Python number) may join any
operation; copies and moves may cross devices; index tensors must lie with the indexed
tensor (CUDA would copy CPU indices over silently, one transfer per call).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

OTHER = torch.device("meta")
_CPU = torch.device("cpu")
_ATEN = torch.ops.aten
# operations that move data between devices on purpose
_CROSSING = {
    _ATEN._to_copy.default,
    _ATEN.copy_.default,
    _ATEN._copy_from.default,
    _ATEN._copy_from_and_resize.default,
    _ATEN._local_scalar_dense.default,
}


class PlacementError(RuntimeError):
    """An operation mixed tensors of the CPU and of the other device."""


class OnOther(torch.Tensor):
    """A CPU tensor that reports the device ``meta`` (only meaningful inside ``OtherDevice``)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnOther:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=OTHER,
            requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"OnOther({self.inner!r})"

    def __reduce_ex__(self, protocol: int) -> Any:  # saved as its CPU data (map_location)
        return self.inner.__reduce_ex__(protocol)

    def tolist(self) -> Any:  # a GPU tensor allows it (one copy); torch refuses subclasses
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise PlacementError(f"{func}: a tensor of OtherDevice used outside its context")


def _unwrap(value: Any) -> Any:
    return value.inner if isinstance(value, OnOther) else value


def _wrap(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, OnOther):
        return OnOther(value)
    return value


def _names_other(device: Any) -> bool:
    return device is not None and torch.device(device).type == OTHER.type


class OtherDevice(TorchDispatchMode):
    """The context in which ``OTHER`` is a computing device (see the module docstring).

    ``mixed``: every operation that mixed devices (raised at once unless ``strict=False``);
    ``cpu_factories``: operations that made a CPU tensor from no tensor at all (``torch.zeros``
    without ``device=``), a likely miss when everything should be on the model's device.
    """

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.mixed: list[str] = []
        self.cpu_factories: list[str] = []

    def __enter__(self) -> OtherDevice:
        # loading weights into the other device's tensors copies them for real: torch's
        # warning that a copy into a meta tensor does nothing does not apply
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=".*to a meta parameter.*is a no-op")
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._warnings.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_other = any(isinstance(t, OnOther) for t in tensors)
        if func in _CROSSING:
            return self._cross(func, args, kwargs)
        made_other = _names_other(kwargs.get("device"))
        if made_other:
            kwargs["device"] = _CPU
        if on_other:
            plain = [t for t in tensors if not isinstance(t, OnOther) and t.dim() > 0]
            if plain:
                message = (
                    f"{func}: expected all tensors on one device, got {OTHER.type} and "
                    f"{plain[0].device} (shape {tuple(plain[0].shape)})"
                )
                self.mixed.append(message)
                if self.strict:
                    raise PlacementError(message)
        elif not tensors and not made_other:
            self.cpu_factories.append(str(func))
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if on_other or made_other:
            out = tree_map(_wrap, out)
            return return_and_correct_aliasing(func, args, kwargs, out)
        return out

    def _cross(self, func, args, kwargs):  # noqa: ANN001, ANN202
        if func is _ATEN._to_copy.default:
            source = args[0]
            target = kwargs.get("device")
            to_other = _names_other(target) or (target is None and isinstance(source, OnOther))
            kwargs["device"] = _CPU if target is not None else None
            out = func(_unwrap(source), **kwargs)
            return OnOther(out) if to_other else out
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is _ATEN._local_scalar_dense.default:
            return out
        # copy_ and friends write into their first argument, which keeps its device
        return args[0]


def nonzero_on_meta():  # noqa: ANN201
    """A context in which ``torch.nonzero`` runs on meta tensors (as if every element were
    non-zero: shapes are then those of a batch where each atom has every type), so that a
    forward selecting atoms by type runs on the meta device."""
    from torch.fx.experimental import _config

    return _config.patch(meta_nonzero_assume_all_nonzero=True)


def module_devices(module: torch.nn.Module) -> set[torch.device]:
    """The devices of a module's parameters and buffers."""
    return {t.device for t in [*module.parameters(), *module.buffers()]}


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested structure of dicts, lists and tuples."""
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf
