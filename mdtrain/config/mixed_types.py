"""Which descriptors see the neighbours of all types as one list (DeePMD's ``mixed_types``).

Such a descriptor takes ``sel`` as one integer (a list means its sum), and its neighbour
statistics count the neighbours of all types together. Kept here, at the config layer, so
that the schema checks, ``mdtrain neighbor-stat`` and the ``sel`` resolution agree without
importing the models (the neighbour statistics must not import ``mdtrain.model``). The
descriptor registry (``mdtrain.model.descriptors``) must agree with
``MIXED_TYPES_DESCRIPTORS`` for every type and alias it registers.
"""

from __future__ import annotations

from typing import Any

# DeePMD-kit's type names and aliases of the descriptors with one type-mixed neighbour list
MIXED_TYPES_DESCRIPTORS = ("se_atten", "dpa1", "se_atten_v2", "se_e3_tebd")
# ... and of those with a rotation matrix (DeePMD-kit's ``rot_mat``; a hybrid has one when
# every member has), which the dipole and polar fittings contract with
ROTATION_DESCRIPTORS = ("se_e2_a", "se_a", "se_atten", "dpa1", "se_atten_v2")


def mixed_types(descriptor: Any) -> bool:
    """True when the descriptor section names a descriptor with one type-mixed neighbour
    list (its ``sel`` is one integer)."""
    return isinstance(descriptor, dict) and descriptor.get("type") in MIXED_TYPES_DESCRIPTORS


def mixed_list(descriptor: Any) -> bool:
    """True when the model's neighbour list is one type-mixed list (DeePMD-kit's
    ``descriptor.mixed_types()``): a type-mixed descriptor, or a ``hybrid`` with such a
    member (any member, as DeePMD-kit's hybrid ``mixed_types`` says; its per-type members
    take per-type blocks drawn from that list)."""
    if not isinstance(descriptor, dict):
        return False
    if descriptor.get("type") == "hybrid":
        return any(mixed_list(m) for m in descriptor.get("list") or [])
    return mixed_types(descriptor)


def shares_fitting_net(descriptor: Any) -> bool:
    """True when the model has ONE fitting net for all atom types (DeePMD-kit's fitting
    ``mixed_types``, set from ``descriptor.mixed_types()`` when the model is built): the
    rule of `mixed_list`. Its input, the descriptor, then tells the types apart."""
    return mixed_list(descriptor)


def integer_sel_problem(descriptor: Any, where: str = "model.descriptor") -> str | None:
    """The one-line problem of an integer ``sel`` given to a descriptor that needs a list."""
    sel = descriptor.get("sel") if isinstance(descriptor, dict) else None
    if isinstance(sel, bool) or not isinstance(sel, int) or mixed_types(descriptor):
        return None
    return (
        f"{where}.sel: one integer for all types is taken only by "
        f"{', '.join(MIXED_TYPES_DESCRIPTORS)}; {descriptor.get('type')} needs a list with "
        'one entry per element of model.type_map (or "auto")'
    )


def rotation_problem(descriptor: Any, fitting: str, where: str, sep: str) -> str | None:
    """The one-line problem of a ``dipole``/``polar`` fitting on a descriptor without a
    rotation matrix (DeePMD-kit fails on it too), naming the key (``sep`` joins the path: "."
    in the config checks, "/" in the model's errors); a hybrid's member by its index."""
    if not isinstance(descriptor, dict):
        return None
    kind = descriptor.get("type", "se_e2_a")
    if kind == "hybrid":
        for k, member in enumerate(descriptor.get("list") or []):
            found = rotation_problem(member, fitting, f"{where}{sep}list[{k}]", sep)
            if found:
                return found
        return None
    if kind in ROTATION_DESCRIPTORS or not isinstance(kind, str):
        return None
    return (
        f"{where}{sep}type: {kind!r} gives no rotation matrix, which a {fitting} fitting needs "
        "(se_e2_a, se_atten, se_atten_v2 and hybrids of them do)"
    )
