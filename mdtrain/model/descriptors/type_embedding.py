"""DeePMD-kit's type embedding network (``TypeEmbedNet``): one learnt vector per atom type.

Type ``t`` is the one-hot vector ``e_t`` passed through a residual dense stack (by default
without biases, ``use_tebd_bias``). With ``padding`` a row of zeros is appended for type
``ntypes``, the type of empty neighbour slots where a caller asks for it. The table is
recomputed on every call, so gradients reach the stack's weights.
"""

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.layers import DenseNet, activation_name
from mdtrain.model.network import dtype_of


class TypeEmbedNet(nn.Module):
    """``forward() -> (ntypes [+1], neuron[-1])`` in the net's dtype."""

    ntypes: int
    padding: bool

    def __init__(
        self,
        ntypes: int,
        neuron: list[int],
        activation_function: str = "tanh",
        resnet_dt: bool = False,
        precision: str = "default",
        trainable: bool = True,
        seed: int | None = None,
        padding: bool = False,
        use_econf_tebd: bool = False,
        use_tebd_bias: bool = False,
        type_map: list[str] | None = None,
    ) -> None:
        super().__init__()
        where = "type_embedding"
        if use_econf_tebd:
            raise MDTrainError(
                f"{where}: use_econf_tebd (electronic-configuration type embedding) is not "
                "supported; use the one-hot type embedding (use_econf_tebd false)"
            )
        self.ntypes = int(ntypes)
        self.padding = bool(padding)
        self.type_map = list(type_map) if type_map is not None else None
        self.dtype = dtype_of(precision, where)
        self.precision = precision
        self.activation = activation_name(activation_function, where)
        self.net = DenseNet(
            ntypes,
            list(neuron),
            self.activation,
            resnet_dt,
            bias=use_tebd_bias,
            dtype=self.dtype,
            seed=seed,
            trainable=trainable,
        )

    @property
    def dim_out(self) -> int:
        return self.net.dim_out

    def forward(self) -> Tensor:
        weight = self.net.layers[0].weight
        table = self.net(torch.eye(self.ntypes, dtype=weight.dtype, device=weight.device))
        if self.padding:
            table = torch.cat([table, table.new_zeros(1, table.shape[1])], dim=0)
        return table

    def to_deepmd(self) -> dict:
        net = self.net.to_deepmd()
        if self.activation == "linear":  # DeePMD-kit's spelling for its type embeddings
            net["activation_function"] = "Linear"
            for layer in net["layers"]:
                layer["activation_function"] = "Linear"
        return {
            "@class": "TypeEmbedNet",
            "@version": 2,
            "ntypes": self.ntypes,
            "neuron": net["neuron"],
            "resnet_dt": net["resnet_dt"],
            "precision": self.precision,
            "activation_function": "Linear" if self.activation == "linear" else self.activation,
            "trainable": self.net.layers[0].weight.requires_grad,
            "padding": self.padding,
            "use_econf_tebd": False,
            "use_tebd_bias": net["bias"],
            "type_map": self.type_map,
            "embedding": net,
        }

    @classmethod
    def from_deepmd(cls, data: dict, where: str = "type_embedding") -> "TypeEmbedNet":
        """A type embedding from DeePMD-kit's serialised ``TypeEmbedNet`` dict."""
        if data.get("@class") != "TypeEmbedNet":
            raise MDTrainError(f"{where}: expected a TypeEmbedNet, found {data.get('@class')!r}")
        if data.get("use_econf_tebd"):
            raise MDTrainError(f"{where}: use_econf_tebd is not supported")
        precision = str(data.get("precision", "default"))
        if precision not in ("default", "float32", "float64"):
            raise MDTrainError(f"{where}/precision: {precision!r} is not supported")
        obj = cls(
            int(data["ntypes"]),
            list(data["neuron"]),
            str(data.get("activation_function", "tanh")),
            bool(data.get("resnet_dt", False)),
            precision,
            bool(data.get("trainable", True)),
            padding=bool(data.get("padding", False)),
            use_tebd_bias=bool(data.get("use_tebd_bias", True)),  # version 1 had biases
            type_map=data.get("type_map"),
        )
        obj.net = DenseNet.from_deepmd(data["embedding"], obj.dtype, f"{where}.embedding")
        if obj.net.n_in != obj.ntypes:
            raise MDTrainError(f"{where}: the network takes {obj.net.n_in} inputs, not ntypes")
        return obj
