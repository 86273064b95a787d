"""DPA-1's gated self-attention over the neighbour slots of each atom (DeePMD-kit 3.2).

One layer: ``q, k, v`` from one projection of the slot embeddings ``G`` (B, nnei, M),
each normalised to unit length (``normalize``), ``q`` scaled by ``(d·scaling_factor)^-½``
(or by ``temperature`` when given). Weights ``softmax_j(q·k)``: with ``smooth`` the logits
are blended as ``(L + 20)·s_i·s_j − 20`` with the switch ``s`` and the weights multiplied
by ``s_i·s_j`` afterwards; without it empty keys are left out of the softmax. Rows of empty
slots are zeroed, ``attn_dotr`` multiplies by the cosines ``r̂_i·r̂_j``; the output
projection of ``A v`` is added to ``G`` and layer-normalised.
"""

import torch
from torch import Tensor, nn

from mdtrain.errors import MDTrainError
from mdtrain.model.descriptors.layers import DenseLayer, LayerNorm
from mdtrain.model.network import child_seed


class GatedAttentionLayer(nn.Module):
    """One residual attention layer (DeePMD-kit's NeighborGatedAttentionLayer)."""

    hidden: int
    scaling: float
    normalize: bool
    smooth: bool
    dotr: bool

    def __init__(
        self,
        embed_dim: int,
        hidden: int,
        dotr: bool,
        scaling_factor: float,
        normalize: bool,
        temperature: float | None,
        trainable_ln: bool,
        ln_eps: float,
        smooth: bool,
        dtype: torch.dtype,
        seed: int | None,
        trainable: bool,
    ) -> None:
        super().__init__()
        self.hidden = int(hidden)
        self.dotr = bool(dotr)
        self.scaling_factor = float(scaling_factor)
        self.temperature = None if temperature is None else float(temperature)
        self.scaling = (
            (self.hidden * self.scaling_factor) ** -0.5
            if self.temperature is None
            else self.temperature
        )
        self.normalize = bool(normalize)
        self.smooth = bool(smooth)
        s0, s1 = child_seed(seed, 0), child_seed(seed, 1)
        self.in_proj = DenseLayer(embed_dim, 3 * hidden, dtype=dtype, seed=s0, trainable=trainable)
        self.out_proj = DenseLayer(hidden, embed_dim, dtype=dtype, seed=s1, trainable=trainable)
        self.norm = LayerNorm(embed_dim, ln_eps, trainable_ln and trainable, dtype)

    def forward(self, g: Tensor, key_mask: Tensor, pair_sw: Tensor, gate: Tensor) -> Tensor:
        """``g`` (B, nnei, M); ``key_mask`` (B, 1, nnei) bool, ``pair_sw`` (B, nnei, nnei)
        ``s_i·s_j`` and ``gate`` (B, nnei, nnei) the factor of the weights, from
        `attention_inputs` (the same for every layer, so computed once)."""
        # split, not slices: a slice's backward fills a zero tensor of the whole width
        q, k, v = torch.split(self.in_proj(g), self.hidden, dim=-1)
        if self.normalize:  # times 1/|x|: a product costs less than a quotient, both ways
            q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True))
            k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True))
            v = v * torch.rsqrt((v * v).sum(dim=-1, keepdim=True))
        logits = torch.matmul(q * self.scaling, k.transpose(1, 2))  # (B, i, j)
        if self.smooth:
            logits = (logits + 20.0) * pair_sw - 20.0  # 20: DeePMD-kit's attnw_shift
        else:
            # a finite floor, not -inf (exp of it is 0 all the same): a centre with no
            # neighbour keeps finite values and gradients
            logits = logits.masked_fill(~key_mask, -1e30)
        weights = torch.softmax(logits, dim=-1) * gate
        out = self.out_proj(torch.matmul(weights, v))
        return self.norm(g + out)

    def to_deepmd(self, nnei: int, ln_eps: float, trainable_ln: bool, precision: str) -> dict:
        """DeePMD-kit's layer dict; ``precision`` the configured name ("default" stays)."""
        common = {
            "nnei": nnei,
            "embed_dim": self.in_proj.n_in,
            "hidden_dim": self.hidden,
            "dotr": self.dotr,
            "do_mask": False,
            "scaling_factor": self.scaling_factor,
            "normalize": self.normalize,
            "temperature": self.temperature,
            "precision": precision,
        }
        attention = {
            **common,
            "num_heads": 1,
            "bias": True,
            "smooth": self.smooth,
            "in_proj": self.in_proj.to_deepmd(),
            "out_proj": self.out_proj.to_deepmd(),
        }
        return {
            **common,
            "trainable_ln": trainable_ln,
            "ln_eps": ln_eps,
            "attention_layer": attention,
            "attn_layer_norm": self.norm.to_deepmd(precision),
        }

    def load_deepmd(self, data: dict, where: str) -> None:
        """Take the weights of DeePMD-kit's serialised layer (settings checked by the caller)."""
        attention = data["attention_layer"]
        if int(attention.get("num_heads", 1)) != 1 or not attention.get("bias", True):
            raise MDTrainError(f"{where}: only one attention head with biases is supported")
        dtype = self.in_proj.weight.dtype
        trainable = self.in_proj.weight.requires_grad
        self.in_proj = DenseLayer.from_deepmd(attention["in_proj"], dtype, f"{where}.in_proj")
        self.out_proj = DenseLayer.from_deepmd(attention["out_proj"], dtype, f"{where}.out_proj")
        self.norm = LayerNorm.from_deepmd(data["attn_layer_norm"], dtype, f"{where}.norm")
        for p in (*self.in_proj.parameters(), *self.out_proj.parameters()):
            p.requires_grad_(trainable)
        if (self.in_proj.n_in, self.in_proj.n_out) != (self.norm.weight.shape[0], 3 * self.hidden):
            raise MDTrainError(f"{where}: in_proj has the wrong shape")


def attention_inputs(
    mask: Tensor, sw: Tensor, r_hat: Tensor, smooth: bool, dotr: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(key_mask, pair_sw, gate)`` of `GatedAttentionLayer.forward` from the slots' mask
    (B, nnei) bool, switch (B, nnei) and unit directions (B, nnei, 3): the weights of a row
    of an empty slot are 0, times ``s_i·s_j`` when ``smooth``, times ``r̂_i·r̂_j`` when
    ``dotr``."""
    pair_sw = sw.unsqueeze(2) * sw.unsqueeze(1)
    gate = mask.unsqueeze(2).to(sw.dtype).expand_as(pair_sw)
    if smooth:
        gate = gate * pair_sw
    if dotr:
        gate = gate * torch.matmul(r_hat, r_hat.transpose(1, 2))
    return mask.unsqueeze(1), pair_sw, gate


def attention_to_deepmd(layers: nn.ModuleList, nnei: int, embed_dim: int, settings: dict) -> dict:
    """DeePMD-kit's ``NeighborGatedAttention`` dict of a stack of layers."""
    return {
        "@class": "NeighborGatedAttention",
        "@version": 1,
        "layer_num": len(layers),
        "nnei": nnei,
        "embed_dim": embed_dim,
        "hidden_dim": settings["attn"],
        "dotr": settings["attn_dotr"],
        "do_mask": False,
        "scaling_factor": settings["scaling_factor"],
        "normalize": settings["normalize"],
        "temperature": settings["temperature"],
        "trainable_ln": settings["trainable_ln"],
        "ln_eps": settings["ln_eps"],
        "precision": settings["precision"],
        "attention_layers": [
            layer.to_deepmd(
                nnei, settings["ln_eps"], settings["trainable_ln"], settings["precision"]
            )
            for layer in layers
        ],
    }
