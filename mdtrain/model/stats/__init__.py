"""Model statistics, one job a module: ``share`` (how ranks split them), ``sampling`` (which
frames), ``pairs`` (environment sums from neighbour pairs, per the descriptor's
``pair_stat_terms``), ``collector`` (those sums gathered during the neighbour statistics),
``energy_bias`` (the least-squares bias), ``compute`` (the orchestrator, with the stat file).
The padded-list reference of the sums lives in the tests (``tests/helpers/padded_stats.py``).
"""

from mdtrain.model.descriptors.base import STD_DEFAULT, STD_PROTECTION, StatItem
from mdtrain.model.stats.collector import StatCollector
from mdtrain.model.stats.compute import compute_or_load_stats, stream_stat_inputs
from mdtrain.model.stats.energy_bias import compute_energy_bias, energy_bias_factor
from mdtrain.model.stats.pairs import PairStatSums, frame_pairs
from mdtrain.model.stats.sampling import (
    auto_batch_size,
    collect_stat_batches,
    model_device,
    my_stat_plan,
    stat_batch_plan,
    stat_frames,
    stat_inputs,
)
from mdtrain.model.stats.share import ALONE, StatShare

__all__ = [
    "ALONE",
    "STD_DEFAULT",
    "STD_PROTECTION",
    "PairStatSums",
    "StatCollector",
    "StatItem",
    "StatShare",
    "auto_batch_size",
    "collect_stat_batches",
    "compute_energy_bias",
    "compute_or_load_stats",
    "energy_bias_factor",
    "frame_pairs",
    "model_device",
    "my_stat_plan",
    "stat_batch_plan",
    "stat_frames",
    "stat_inputs",
    "stream_stat_inputs",
]
