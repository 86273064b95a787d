"""The tensor models: a descriptor with a rotation matrix (se_e2_a, se_atten, se_atten_v2 or
a hybrid of them) + dipole or polar fitting (DeePMD-kit's
``DipoleModel``/``PolarModel``), giving atomic and global (summed) tensors. No forces: the
tensors are fitted and evaluated as they are.

Outputs, float64: ``atom_dipole`` (nf, N, 3) and ``dipole`` (nf, 3), or
``atom_polarizability`` (nf, N, 9) and ``polarizability`` (nf, 9), 3x3 matrices row-major as
in DeePMD-kit's label files. Atoms of excluded types (``atom_exclude_types``, the types
outside ``sel_type``) give zero. The buffer ``out_bias`` (ntypes, 3 or 9) is DeePMD-kit's
atomic-model output bias: dipoles ignore it (as DeePMD-kit does); a polar model with
``shift_diag`` adds the mean of its diagonal, times ``scale``, to each atom's diagonal.
"""

from torch import Tensor

from mdtrain.config.mixed_types import rotation_problem, shares_fitting_net
from mdtrain.errors import MDTrainError
from mdtrain.model.config import normalize_model_config
from mdtrain.model.fittings.config import excluded_types
from mdtrain.model.fittings.dipole import DipoleFitting
from mdtrain.model.fittings.nets import TypeFittingNets
from mdtrain.model.fittings.polar import PolarFitting
from mdtrain.model.network import check_activation, dtype_of
from mdtrain.model.output_model import OutputModel

# fitting type -> (label name, values per atom)
TENSOR_LABELS = {"dipole": ("dipole", 3), "polar": ("polarizability", 9)}


def build_tensor_fitting(
    fit: dict, ntypes: int, dim_in: int, width: int, exclude: list[int], mixed_types: bool = False
):
    """The dipole or polar fitting of a normalised ``fitting_net`` section (``mixed_types``:
    one net for all types, `mdtrain.config.shares_fitting_net` of the descriptor)."""
    where = "model/fitting_net"
    given = fit.get("embedding_width")
    if given is not None and int(given) != width:
        raise MDTrainError(f"{where}/embedding_width: {given}, but the descriptor gives {width}")
    polar = fit["type"] == "polar"
    n_out = width * width if polar and not fit["fit_diag"] else width
    nets = TypeFittingNets(
        ntypes,
        dim_in,
        n_out,
        [int(n) for n in fit["neuron"]],
        check_activation(fit["activation_function"], where),
        bool(fit["resnet_dt"]),
        dtype_of(fit["precision"], f"{where}/precision"),
        fit["seed"],
        exclude,
        mixed_types,
    )
    if not polar:
        return DipoleFitting(nets, width)
    return PolarFitting(nets, width, fit["fit_diag"], fit["shift_diag"], fit["scale"])


class TensorModel(OutputModel):
    """A dipole or polarizability model; ``forward`` as `EnergyModel`'s, other outputs."""

    kind: str
    label: str
    tensor_size: int

    def __init__(self, model_config: dict) -> None:
        cfg = normalize_model_config(model_config)
        kind = cfg["fitting_net"]["type"]
        super().__init__(cfg, excluded_types(cfg), TENSOR_LABELS[kind][1])
        desc, fit = cfg["descriptor"], cfg["fitting_net"]
        self.kind = kind
        self.label, self.tensor_size = TENSOR_LABELS[self.kind]
        problem = rotation_problem(desc, self.kind, "model/descriptor", "/")
        if problem:
            raise MDTrainError(problem)
        width = int(self.descriptor.dim_emb)
        self.fitting = build_tensor_fitting(
            fit,
            self.ntypes,
            self.descriptor.dim_out,
            width,
            self.excluded,
            shares_fitting_net(desc),
        )

    def sel_type(self) -> list[int]:
        """The types whose atoms carry a tensor (DeePMD-kit's ``get_sel_type``)."""
        return [t for t in range(self.ntypes) if t not in self.excluded]

    def atomic_tensor(self, diff: Tensor, nlist: Tensor, atype: Tensor) -> Tensor:
        """Atomic tensors (nf, N, size) float64 from pair vectors."""
        d, gr = self.descriptor.forward_with_rot(diff, nlist, atype)
        out = self.fitting(d, gr, atype, self.out_bias)
        return out * self.atom_keep[atype].view(1, -1, 1)

    def forward(
        self, coord: Tensor, atype: Tensor, box: Tensor | None, nlist: Tensor, shift: Tensor
    ) -> dict[str, Tensor]:
        """``atom_<label>`` (nf, N, size) and ``<label>`` (nf, size); arguments as
        `EnergyModel.forward`'s."""
        atomic = self.atomic_tensor(self.pairs(coord, box, nlist, shift), nlist, atype)
        return {f"atom_{self.label}": atomic, self.label: atomic.sum(dim=1)}
