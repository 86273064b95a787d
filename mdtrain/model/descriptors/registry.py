"""The descriptors mdtrain builds, keyed by DeePMD-kit's type names and aliases.

A new descriptor is one module in this package (a ``Descriptor`` subclass), one entry in
``_IMPLEMENTED`` below, and one section in ``input_schemas/input.schema.json``; the test
battery (``tests/model/test_descriptor_battery.py``) then runs on it by itself.
"""

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.base import Descriptor
from mdtrain.model.descriptors.hybrid import DescriptorHybrid
from mdtrain.model.descriptors.se_atten import DescriptorSeAtten, DescriptorSeAttenV2
from mdtrain.model.descriptors.se_e2_a import DescriptorSeA
from mdtrain.model.descriptors.se_e2_r import DescriptorSeR
from mdtrain.model.descriptors.se_e3 import DescriptorSeT
from mdtrain.model.descriptors.se_e3_tebd import DescriptorSeE3Tebd

_IMPLEMENTED: tuple[type[Descriptor], ...] = (
    DescriptorSeA,
    DescriptorSeR,
    DescriptorSeT,
    DescriptorHybrid,
    DescriptorSeAtten,
    DescriptorSeAttenV2,
    DescriptorSeE3Tebd,
)

# Every descriptor type DeePMD-kit 3.2 accepts (name: aliases), for the messages.
DEEPMD_TYPES: dict[str, tuple[str, ...]] = {
    "se_e2_a": ("se_a",),
    "se_e2_r": ("se_r",),
    "se_e3": ("se_at", "se_a_3be", "se_t"),
    "se_atten": ("dpa1",),
    "se_atten_v2": (),
    "se_e3_tebd": (),
    "hybrid": (),
    "dpa2": (),
    "dpa3": (),
    "se_a_tpe": ("se_a_ebd",),
    "se_a_mask": (),
    "loc_frame": (),
}

DESCRIPTORS: dict[str, type[Descriptor]] = {cls.type_name: cls for cls in _IMPLEMENTED}
ALIASES: dict[str, str] = {a: cls.type_name for cls in _IMPLEMENTED for a in cls.aliases}


def supported_types() -> str:
    """``se_e2_a (alias se_a), ...`` for messages."""
    parts = []
    for name, cls in DESCRIPTORS.items():
        alias = f" (alias {', '.join(cls.aliases)})" if cls.aliases else ""
        parts.append(name + alias)
    return ", ".join(parts)


def canonical_type(name: object, where: str = "model/descriptor") -> str:
    """The registry's name for a descriptor type or alias; one line naming the supported
    ones when mdtrain does not build it."""
    if isinstance(name, str) and name in DESCRIPTORS:
        return name
    if isinstance(name, str) and name in ALIASES:
        return ALIASES[name]
    known = isinstance(name, str) and any(name == k or name in a for k, a in DEEPMD_TYPES.items())
    what = "is not implemented in mdtrain" if known else "is not a descriptor type"
    raise MDTrainError(f"{where}/type: {name!r} {what}; supported: {supported_types()}")


def descriptor_class(name: object, where: str = "model/descriptor") -> type[Descriptor]:
    """The class that builds descriptor type ``name`` (a DeePMD-kit name or alias)."""
    return DESCRIPTORS[canonical_type(name, where)]


def deepmd_descriptor_class(kind: object) -> type[Descriptor] | None:
    """The class that reads DeePMD-kit's serialised descriptor type ``kind``, or None."""
    for cls in DESCRIPTORS.values():
        if kind in cls.deepmd_types:
            return cls
    return None


def build_descriptor(desc: dict, ntypes: int) -> Descriptor:
    """The descriptor of a normalised ``model.descriptor`` section."""
    return descriptor_class(desc["type"]).from_config(desc, ntypes)


def list_cut(desc: dict) -> tuple[float, list[int]]:
    """``rcut`` and ``sel`` of the neighbour list a filled ``model.descriptor`` needs (a
    hybrid's: its members' largest)."""
    return descriptor_class(desc.get("type", "se_e2_a")).list_cut(desc)
