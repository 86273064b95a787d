"""The descriptors: one module per DeePMD-kit descriptor behind ``base.Descriptor``, found
by type name or alias through ``registry``."""

from mdtrain.model.descriptors.base import Descriptor, StatItem, smooth_weight
from mdtrain.model.descriptors.registry import (
    DESCRIPTORS,
    build_descriptor,
    canonical_type,
    deepmd_descriptor_class,
    descriptor_class,
    list_cut,
    supported_types,
)

__all__ = [
    "DESCRIPTORS",
    "Descriptor",
    "StatItem",
    "build_descriptor",
    "deepmd_descriptor_class",
    "canonical_type",
    "descriptor_class",
    "list_cut",
    "smooth_weight",
    "supported_types",
]
