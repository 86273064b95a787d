"""Load input.json: parse, drop ``_`` keys, resolve aliases, fill defaults, validate.

One module per job; imports flow one way: ``loader`` uses the other three, ``schema_walk``
and ``checks`` use ``wording``, and ``wording`` uses none of them.

- ``loader``: the entry points (``load_config``, ``complete_config``, ...) and the pipeline;
- ``schema_walk``: comments, aliases and defaults, read from the JSON Schema;
- ``wording``: one message per problem (schema errors, unknown keys, values shown short);
- ``checks``: checks that relate several fields;
- ``mixed_types``: which descriptors take one type-mixed neighbour list (an integer ``sel``),
  and which models have one fitting net for all types (``shares_fitting_net``).
"""

from mdtrain.config.loader import (
    complete_config,
    dump_config,
    load_config,
    normalize_config,
    parse_json,
    resolve_path,
    validate_config,
)
from mdtrain.config.mixed_types import (
    MIXED_TYPES_DESCRIPTORS,
    mixed_list,
    mixed_types,
    shares_fitting_net,
)
from mdtrain.config.wording import format_problems

__all__ = [
    "MIXED_TYPES_DESCRIPTORS",
    "complete_config",
    "dump_config",
    "format_problems",
    "load_config",
    "mixed_list",
    "mixed_types",
    "normalize_config",
    "parse_json",
    "resolve_path",
    "shares_fitting_net",
    "validate_config",
]
