"""The invariant-output models: a descriptor + a DOS or property fitting (DeePMD-kit 3.2's
``DOSModel`` / ``PropertyModel``), giving an atomic output of ``numb_dos`` / ``task_dim``
values per atom and its frame reduction. No forces: the outputs are fitted as they are.

Per atom ``i`` of type ``t`` (``deepmd/dpmodel/atomic_model``'s ``apply_out_stat``)::

    dos:       o_i = F_t(D_i) + out_bias[t]
    property:  o_i = F_t(D_i) * out_std[t] + out_bias[t]   (distinguish_types; else type 0's)

where ``F_t`` is the fitting net of type ``t`` plus its ``bias_atom_e`` (DeePMD-kit's
``GeneralFitting``); after a type-mixed descriptor (dpa1, ...) one net serves every type, as
DeePMD-kit builds it (`mdtrain.config.shares_fitting_net`), the bias staying per type. Atoms of ``atom_exclude_types`` give zero. The frame output is the sum
over atoms, or for an ``intensive`` property the mean over the atoms not excluded.

Outputs, float64: ``atom_<name>`` (nf, N, k) and ``<name>`` (nf, k), ``<name>`` ``dos`` or the
``property_name`` (the label files' names).
"""

import torch
from torch import Tensor

from mdtrain.config.mixed_types import shares_fitting_net
from mdtrain.model.config import normalize_model_config
from mdtrain.model.fittings.invariant_config import output_name, output_width
from mdtrain.model.fittings.nets import TypeFittingNets
from mdtrain.model.network import check_activation, dtype_of
from mdtrain.model.output_model import OutputModel


def build_invariant_fitting(
    fit: dict, ntypes: int, dim_in: int, exclude: list[int], mixed_types: bool = False
):
    """The nets of a normalised ``dos``/``property`` ``fitting_net`` section: one per type,
    or with ``mixed_types`` (a type-mixed descriptor's, as DeePMD-kit builds it) one for
    all."""
    where = "model/fitting_net"
    nets = TypeFittingNets(
        ntypes,
        dim_in,
        output_width(fit),
        [int(n) for n in fit["neuron"]],
        check_activation(fit["activation_function"], where),
        bool(fit["resnet_dt"]),
        dtype_of(fit["precision"], f"{where}/precision"),
        fit["seed"],
        exclude,
        mixed_types,
        int(fit["numb_fparam"]),
        int(fit["numb_aparam"]),
        fit["default_fparam"],
    )
    for p in nets.parameters():
        p.requires_grad_(bool(fit["trainable"]))
    return nets


class InvariantModel(OutputModel):
    """A DOS or property model; ``forward`` as `EnergyModel`'s, other outputs."""

    kind: str
    output: str
    width: int
    intensive: bool
    distinguish_types: bool

    def __init__(self, model_config: dict) -> None:
        cfg = normalize_model_config(model_config)
        fit = cfg["fitting_net"]
        super().__init__(cfg, cfg["atom_exclude_types"], output_width(fit))
        self.kind = fit["type"]
        self.output = output_name(fit)
        self.width = output_width(fit)
        self.intensive = bool(fit.get("intensive", False))
        self.distinguish_types = bool(fit.get("distinguish_types", True))
        self.fitting = build_invariant_fitting(
            fit,
            self.ntypes,
            self.descriptor.dim_out,
            self.excluded,
            shares_fitting_net(cfg["descriptor"]),
        )

    def atomic_output(
        self,
        diff: Tensor,
        nlist: Tensor,
        atype: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> Tensor:
        """Atomic outputs (nf, N, k) float64 from pair vectors (and the frame and atomic
        parameters of a model that takes them)."""
        d = self.descriptor(diff, nlist, atype)
        out = self.fitting(d, atype, fparam, aparam).to(torch.float64)
        if self.kind == "property":
            index = atype if self.distinguish_types else torch.zeros_like(atype)
            out = out * self.out_std[index] + self.out_bias[index]
        else:
            out = out + self.out_bias[atype]
        return out * self.atom_keep[atype].view(1, -1, 1)

    def forward(
        self,
        coord: Tensor,
        atype: Tensor,
        box: Tensor | None,
        nlist: Tensor,
        shift: Tensor,
        fparam: Tensor | None = None,
        aparam: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """``atom_<name>`` (nf, N, k) and ``<name>`` (nf, k); arguments as
        `EnergyModel.forward`'s (``fparam`` (nf, numb_fparam), ``aparam`` (nf, N,
        numb_aparam) for a model with frame or atomic parameters)."""
        diff = self.pairs(coord, box, nlist, shift)
        atomic = self.atomic_output(diff, nlist, atype, fparam, aparam)
        total = atomic.sum(dim=1)
        if self.intensive:
            total = total / self.atom_keep[atype].sum()
        return {f"atom_{self.output}": atomic, self.output: total}
