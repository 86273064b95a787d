"""The gated attention layer of se_atten, written for speed (attention.py), against a plain
transcription of DeePMD-kit's formula: values, first and second derivatives (a force loss
differentiates twice) in float64, for every switch of the layer."""

from __future__ import annotations

import pytest
import torch

from mdtrain.model.descriptors.attention import (
    AttentionStack,
    GatedAttentionLayer,
    attention_inputs,
)


def plain_layer(layer: GatedAttentionLayer, g, mask, sw, r_hat, smooth: bool, dotr: bool):
    """DeePMD-kit's NeighborGatedAttentionLayer as written there: one projection split in
    three, each part normalised, the logits shifted and switched (smooth) or masked, softmax,
    the gates, ``out_proj(A v)``, the residual and the layer norm."""
    h = layer.hidden
    qkv = torch.matmul(g, layer.in_proj.weight) + layer.in_proj.bias
    q, k, v = qkv[..., :h], qkv[..., h : 2 * h], qkv[..., 2 * h :]
    if layer.normalize:
        q, k, v = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k, v))
    logits = torch.matmul(q * layer.scaling, k.transpose(1, 2))
    pair_sw = sw.unsqueeze(2) * sw.unsqueeze(1)
    if smooth:
        logits = (logits + 20.0) * pair_sw - 20.0
    else:
        logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    if smooth:
        weights = weights * pair_sw
    weights = weights * mask.unsqueeze(2)
    if dotr:
        weights = weights * torch.matmul(r_hat, r_hat.transpose(1, 2))
    out = torch.matmul(torch.matmul(weights, v), layer.out_proj.weight) + layer.out_proj.bias
    return layer.norm(g + out)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("dotr", [False, True])
@pytest.mark.parametrize("normalize,temperature", [(True, None), (False, None), (True, 0.7)])
def test_layer_equals_the_plain_formula(smooth, dotr, normalize, temperature) -> None:
    torch.manual_seed(3)
    nb, nnei, width, hidden = 4, 9, 6, 5
    layer = GatedAttentionLayer(
        width, hidden, dotr, 1.3, normalize, temperature, True, 1e-5, smooth, torch.float64, 7,
        True,
    )  # fmt: skip
    with torch.no_grad():  # a layer norm that is not the identity
        layer.norm.weight.normal_()
        layer.norm.bias.normal_()
    mask = torch.rand(nb, nnei) > 0.35
    mask[:, 0] = True  # every centre has a neighbour (the plain formula's -inf needs one)
    x = torch.randn(nb, nnei, 4, dtype=torch.float64, requires_grad=True)  # "coordinates"
    g = torch.tanh(x @ torch.randn(4, width, dtype=torch.float64))
    sw = torch.sigmoid(x[..., 0]) * mask
    r_hat = torch.nn.functional.normalize(x[..., 1:], dim=-1)

    inputs = attention_inputs(mask, sw, r_hat, smooth, dotr)
    fast = layer(g, *inputs)
    plain = plain_layer(layer, g, mask, sw, r_hat, smooth, dotr)
    assert torch.allclose(fast, plain, rtol=0, atol=1e-12)

    probe = torch.randn_like(fast)
    params = [p for p in layer.parameters()]
    grads = []
    for out in (fast, plain):  # a force-like first derivative, then its parameter gradient
        (dx,) = torch.autograd.grad((out * probe).sum(), x, create_graph=True)
        second = torch.autograd.grad((dx * dx).sum(), params, allow_unused=True)
        grads.append((dx, second))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert (a is None) == (b is None)  # the norm's bias does not reach dx
        assert a is None or torch.allclose(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("dotr", [False, True])
@pytest.mark.parametrize("holes", [False, True])
def test_stack_without_empty_slots_equals_the_full_stack(smooth, dotr, holes) -> None:
    """`AttentionStack` leaves the empty slots out of the products (the smooth form's share of the
    softmax folded into one key): the plain layers over all slots give the same values and
    first and second derivatives, with empty slots at the end (padding) or anywhere
    (``holes``: excluded pairs), in the slots' own order."""
    torch.manual_seed(5)
    nb, nnei, width, hidden = 5, 11, 6, 5
    layers = AttentionStack(
        [
            GatedAttentionLayer(
                width, hidden, dotr, 1.0, True, None, True, 1e-5, smooth, torch.float64, 7 + k,
                True,
            )
            for k in range(2)
        ],
        smooth,
        dotr,
    )  # fmt: skip
    with torch.no_grad():
        for layer in layers:
            layer.norm.weight.normal_()
            layer.norm.bias.normal_()
            layer.out_proj.bias.normal_()
    counts = torch.tensor([7, 3, 1, 6, 0])  # at most 7 of 11 real; a centre without any
    mask = torch.arange(nnei).unsqueeze(0) < counts.unsqueeze(1)
    if holes:  # the same counts, scattered
        mask = torch.stack([m[torch.randperm(nnei)] for m in mask])
    x = torch.randn(nb, nnei, 4, dtype=torch.float64, requires_grad=True)
    g = torch.tanh(x @ torch.randn(4, width, dtype=torch.float64))
    sw = torch.sigmoid(x[..., 0]) * mask
    r_hat = torch.nn.functional.normalize(x[..., 1:], dim=-1)

    fast = layers(g, mask, sw, r_hat)
    full = g
    for layer in layers:
        if smooth:
            full = plain_layer(layer, full, mask, sw, r_hat, smooth, dotr)
        else:  # the plain formula's -inf needs a real key per row: the layer itself here
            full = layer(full, *attention_inputs(mask, sw, r_hat, smooth, dotr))
    assert torch.allclose(fast, full, rtol=0, atol=1e-12)

    probe = torch.randn_like(fast)
    params = list(layers.parameters())
    grads = []
    for out in (fast, full):
        (dx,) = torch.autograd.grad((out * probe).sum(), x, create_graph=True)
        second = torch.autograd.grad((dx * dx).sum(), params, allow_unused=True)
        grads.append((dx, second))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert (a is None) == (b is None)
        assert a is None or torch.allclose(a, b, rtol=1e-11, atol=1e-11)


def test_folded_key_carries_the_empty_keys_share() -> None:
    """Smooth: one empty key standing for n raises its logit by log n, so the real weights
    are those of the full softmax (a direct check of the fold, without the layers)."""
    logits = torch.tensor([[0.3, -1.2, -20.0, -20.0, -20.0]], dtype=torch.float64)
    full = torch.softmax(logits, dim=-1)[0, :2]
    bias = torch.zeros(1, 1, 3, dtype=torch.float64)
    sw = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    folded_bias = attention_inputs(sw > 0, sw, torch.zeros(1, 3, 3), True, False, 3)[0]
    bias[0, 0, 2] = folded_bias[0, 0, 2] - (20.0 * sw[0, 0] * sw[0, 2] - 20.0)
    folded = torch.softmax(logits[:, :3] + bias[0], dim=-1)[0, :2]
    assert torch.allclose(folded, full, rtol=1e-14, atol=0)
