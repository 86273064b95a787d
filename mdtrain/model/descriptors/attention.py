"""DPA-1's gated self-attention over the neighbour slots of each atom (DeePMD-kit 3.2).

One layer: ``q, k, v`` from one projection of the slot embeddings ``G`` (B, nnei, M),
each normalised to unit length (``normalize``: ``x/max(|x|, 1e-12)``), ``q`` scaled by
``(d·scaling_factor)^-½`` (or by ``temperature`` when given). Weights ``softmax_j(q·k)``: with ``smooth`` the logits
are blended as ``(L + 20)·s_i·s_j − 20`` with the switch ``s`` and the weights multiplied
by ``s_i·s_j`` afterwards; without it empty keys are left out of the softmax. Rows of empty
slots are zeroed, ``attn_dotr`` multiplies by the cosines ``r̂_i·r̂_j``; the output
projection of ``A v`` is added to ``G`` and layer-normalised.
"""

import math

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

    def forward(self, g: Tensor, bias: Tensor, gate: Tensor, sw: Tensor) -> Tensor:
        """``g`` (B, nnei, M); ``bias`` (B, 1|nnei, nnei) the term added to the logits (the
        smooth shift ``20·s_i·s_j − 20``, or −1e30 on empty keys), ``gate`` (B, nnei, nnei)
        the factor of the weights and ``sw`` (B, nnei, 1) the switch when smooth, else 1,
        from `attention_inputs` (the same for every layer, so computed once).

        Written for few passes over the (B, nnei, ·) tensors, which set the cost (twice
        more in a force loss's second derivative): q, k and v by three products on the
        weight's columns (no split, whose backward concatenates); the unit-length
        normalisation, the scaling and the switches ``s_i·s_j`` of the smooth logits as one
        per-row factor of q and of k; v's norm applied after the output projection (a row
        factor commutes with it), and ``A (v W_out)`` instead of ``(A v) W_out`` (100
        columns, not 128). Biases are added after the products, not inside them (addmm,
        baddbmm): TorchScript splits those, and the frozen model must give the same bits."""
        nb, nnei, width = g.shape
        h = self.hidden
        rows = g.reshape(nb * nnei, width)
        w, b = self.in_proj.weight, self.in_proj.bias
        assert b is not None
        q = (torch.mm(rows, w[:, :h]) + b[:h]).view(nb, nnei, h)
        k = (torch.mm(rows, w[:, h : 2 * h]) + b[h : 2 * h]).view(nb, nnei, h)
        v = torch.mm(rows, w[:, 2 * h :]) + b[2 * h :]
        fq, fk = sw * self.scaling, sw
        vw = torch.mm(v, self.out_proj.weight)
        if self.normalize:  # x/max(|x|, 1e-12) as torch's normalize, by a factor per row
            fq = fq * _inverse_norm(q)
            fk = fk * _inverse_norm(k)
            vw = vw * _inverse_norm(v)
        logits = torch.bmm(q * fq, (k * fk).transpose(1, 2)) + bias
        weights = torch.softmax(logits, dim=-1) * gate
        out_bias = self.out_proj.bias
        residual = g if out_bias is None else g + out_bias
        return self.norm(torch.bmm(weights, vw.view(nb, nnei, width)) + residual)

    def idle(self, g: Tensor) -> Tensor:
        """The layer on slots whose row of weights is 0 (empty queries): ``norm(g + b_out)``,
        bit for bit what `forward` gives them (its ``A (v W_out)`` row is exactly 0)."""
        out_bias = self.out_proj.bias
        return self.norm(g if out_bias is None else g + out_bias)

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


def _inverse_norm(x: Tensor) -> Tensor:
    """``1/max(|x|, 1e-12)`` over the last axis (keepdim): a small tensor, so that the
    large ones are multiplied (a product's backward is cheaper than a quotient's)."""
    return 1.0 / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-12)


class AttentionStack(nn.ModuleList):
    """The ``attn_layer`` layers (a ModuleList: DeePMD-kit's and the checkpoints' parameter
    names ``attention.K.…``), run together by `forward` with the empty slots left out."""

    smooth: bool
    dotr: bool

    def __init__(self, layers: list[GatedAttentionLayer], smooth: bool, dotr: bool) -> None:
        super().__init__(layers)
        self.smooth, self.dotr = bool(smooth), bool(dotr)

    def forward(self, g: Tensor, mask: Tensor, sw: Tensor, r_hat: Tensor) -> Tensor:
        """The layers on ``g`` (B, nnei, M), the empty slots left out of the products.

        An empty slot (mask False: padding or an excluded pair) never weighs in a real row:
        its own row of weights is 0, so it only goes through ``norm(g + b_out)`` per layer
        (`GatedAttentionLayer.idle`); as a key it has the logit −1e30 (not smooth: no share
        of the softmax) or exactly −20 (smooth: its switch zeroes its ``q·k``), which adds
        ``exp(−20 − max)`` to every row's denominator. So the slots are ordered real first
        (stable), the products run on the first ``K`` (the most real slots of any centre),
        and the ``nnei − K`` empty ones after them are idle; when smooth, one of these stays
        in the window as the key standing for all of them, its logit raised by
        ``log(nnei − K)``. The logits cost ``K²`` instead of ``nnei²``; the result, in the
        slots' own order, is the full stack's to rounding (tests/model/test_attention.py)."""
        nnei = g.shape[1]
        real = int(mask.sum(dim=1).max()) if mask.shape[0] > 0 else 0
        window = real + 1 if self.smooth else real
        if window >= nnei:  # nothing to leave out
            return self.full(g, mask, sw, r_hat)
        window = max(window, 1)
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True)[1]  # real slots first
        head, tail = order[:, :window], order[:, window:]
        folded = nnei - real if self.smooth else 0
        inputs = attention_inputs(
            mask.gather(1, head), sw.gather(1, head), _rows(r_hat, head), self.smooth,
            self.dotr, folded,
        )  # fmt: skip
        active, idle = _rows(g, head), _rows(g, tail)
        for layer in self:
            active = layer(active, inputs[0], inputs[1], inputs[2])
            idle = layer.idle(idle)
        inverse = torch.empty_like(order).scatter_(
            1, order, torch.arange(nnei, device=order.device).expand_as(order)
        )
        return _rows(torch.cat([active, idle], dim=1), inverse)

    def full(self, g: Tensor, mask: Tensor, sw: Tensor, r_hat: Tensor) -> Tensor:
        """The layers on every slot of ``g``, the empty ones included."""
        inputs = attention_inputs(mask, sw, r_hat, self.smooth, self.dotr, 0)
        for layer in self:
            g = layer(g, inputs[0], inputs[1], inputs[2])
        return g

    def for_export(self) -> "FullAttentionStack":
        """This stack without the window (`mdtrain.model.export_form`)."""
        return FullAttentionStack(list(self), self.smooth, self.dotr)


class FullAttentionStack(AttentionStack):
    """The layers on every slot, no window: the window's width is read from the mask's
    values, which a ``torch.export`` program cannot do (its sizes are fixed when traced or
    symbolic in the inputs' sizes). The same layers and parameter names; the results are
    `AttentionStack`'s to rounding (tests/infer/test_export_registry.py)."""

    def forward(self, g: Tensor, mask: Tensor, sw: Tensor, r_hat: Tensor) -> Tensor:
        return self.full(g, mask, sw, r_hat)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, j]]`` for (B, n, C) ``x`` and (B, m) ``index``."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def attention_inputs(
    mask: Tensor, sw: Tensor, r_hat: Tensor, smooth: bool, dotr: bool, folded: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """``(bias, gate, sw)`` of `GatedAttentionLayer.forward` from the slots' mask (B, nnei)
    bool, switch (B, nnei) and unit directions (B, nnei, 3). Smooth: the logits
    ``(L + 20)·s_i·s_j − 20`` are ``L·s_i·s_j`` (the switches go into q and k) plus the
    bias ``20·s_i·s_j − 20``, and the weights are multiplied by ``s_i·s_j``; otherwise
    empty keys get a bias of −1e30 (a finite floor, not −inf: a centre without neighbours
    keeps finite values and gradients) and the switch is 1. The weights of a row of an
    empty slot are 0, and times ``r̂_i·r̂_j`` when ``dotr``. ``folded`` (smooth only): the
    last slot, empty, stands for that many empty keys left out (`AttentionStack`): its logit, −20,
    is raised by ``log(folded)``."""
    gate = mask.unsqueeze(2).to(sw.dtype)
    if smooth:
        pair_sw = sw.unsqueeze(2) * sw.unsqueeze(1)
        bias = 20.0 * pair_sw - 20.0  # 20: DeePMD-kit's attnw_shift
        if folded > 1:  # (a product with the scalar: TorchScript would store it as float32)
            width = sw.shape[1]
            last = torch.arange(width, device=sw.device) == width - 1
            bias = bias + last.to(sw.dtype) * math.log(folded)
        gate = gate * pair_sw
        column = sw.unsqueeze(2)
    else:
        bias = torch.zeros_like(sw).masked_fill(~mask, -1e30).unsqueeze(1)
        gate = gate.expand(-1, -1, mask.shape[1])
        column = torch.ones_like(sw).unsqueeze(2)
    if dotr:
        gate = gate * torch.matmul(r_hat, r_hat.transpose(1, 2))
    return bias, gate, column


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
