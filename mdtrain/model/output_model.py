"""What the models without forces share (dipole/polar `TensorModel`, DOS/property
`InvariantModel`): the normalised config, type map, descriptor and neighbour-list settings,
the atomic model's ``out_bias``/``out_std`` (ntypes, values per atom) as DeePMD-kit keeps
them, the excluded types, and the pair vectors of a batch (`mdtrain.model.conservative`'s). The outputs are fitted and
evaluated as they are (no derivatives).
"""

import copy
import json

import torch
from torch import Tensor, nn

from mdtrain.model.conservative import pair_vectors
from mdtrain.model.descriptors import build_descriptor


class OutputModel(nn.Module):
    """The common part: built from a normalised ``model`` section, the types whose atoms
    give zero (``excluded``) and the values per atom of the output (``size``)."""

    type_map: list[str]
    model_config_json: str
    backend: str

    def __init__(self, cfg: dict, excluded: list[int], size: int) -> None:
        super().__init__()
        self._config = cfg
        self.model_config_json = json.dumps(cfg, sort_keys=True)
        self.type_map = list(cfg["type_map"])
        self.ntypes = len(self.type_map)
        self.descriptor = build_descriptor(cfg["descriptor"], self.ntypes)
        self.rcut = float(self.descriptor.rcut)  # the neighbour list's: a hybrid's largest
        self.sel = [int(s) for s in self.descriptor.sel]  # per type, or [total]
        self.mixed_types = bool(self.descriptor.mixed_types)
        self.excluded = sorted(int(t) for t in excluded)
        shape = (self.ntypes, size)
        self.register_buffer("out_bias", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("out_std", torch.ones(shape, dtype=torch.float64))
        keep = torch.ones(self.ntypes, dtype=torch.float64)
        for t in self.excluded:
            keep[t] = 0.0
        self.register_buffer("atom_keep", keep, persistent=False)
        self.backend = "reference"

    @torch.no_grad()
    def set_out_bias(self, bias, std=None) -> None:
        """Install ``out_bias`` (ntypes, values per atom) and, optionally, ``out_std`` (a
        committee's members take the first one's)."""
        self.out_bias.copy_(torch.as_tensor(bias, dtype=torch.float64).reshape(self.out_bias.shape))
        if std is not None:
            self.out_std.copy_(
                torch.as_tensor(std, dtype=torch.float64).reshape(self.out_std.shape)
            )

    def get_model_config(self) -> dict:
        """The normalised ``model`` section; the class built from it rebuilds this model."""
        return copy.deepcopy(self._config)

    def pairs(self, coord: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor) -> Tensor:
        """The batch's pair vectors in float64 (`pair_vectors`)."""
        cell = None if box is None else box.to(torch.float64)
        return pair_vectors(coord.to(torch.float64), cell, nlist, shift)
