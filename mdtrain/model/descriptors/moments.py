"""DPA-1's optional higher angular moments (``lmax`` 2 to 4, DeePMD-kit 3.2's PyTorch key).

With ``lmax`` > 1 the rows ``[s, a]`` a neighbour contributes to ``G^T R`` are extended by
the real solid harmonics of degree 2..lmax of its direction (unit vector ``n``, the
directions divided by ``r + protection``), each scaled by ``w(r)/(r + p)/std_r``, the
switch over the protected distance and the centre type's radial std. The contraction
``D = (G^T R)(G^T R)_<^T`` weighs degree ``l``'s block by ``g_l²``, a trainable gain.
"""

import math

import torch
from torch import Tensor


def _degree2(x: Tensor, y: Tensor, z: Tensor, q: Tensor) -> list[Tensor]:
    return [
        math.sqrt(3.0) * x * y,
        math.sqrt(3.0) * y * z,
        0.5 * (3.0 * z * z - q),
        math.sqrt(3.0) * x * z,
        0.5 * math.sqrt(3.0) * (x * x - y * y),
    ]


def _degree3(x: Tensor, y: Tensor, z: Tensor, q: Tensor) -> list[Tensor]:
    return [
        math.sqrt(5.0 / 8.0) * y * (3.0 * x * x - y * y),
        math.sqrt(15.0) * x * y * z,
        math.sqrt(3.0 / 8.0) * y * (5.0 * z * z - q),
        0.5 * z * (5.0 * z * z - 3.0 * q),
        math.sqrt(3.0 / 8.0) * x * (5.0 * z * z - q),
        0.5 * math.sqrt(15.0) * z * (x * x - y * y),
        math.sqrt(5.0 / 8.0) * x * (x * x - 3.0 * y * y),
    ]


def _degree4(x: Tensor, y: Tensor, z: Tensor, q: Tensor) -> list[Tensor]:
    z2, d2 = z * z, x * x - y * y
    return [
        0.5 * math.sqrt(35.0) * x * y * d2,
        0.25 * math.sqrt(70.0) * y * z * (3.0 * x * x - y * y),
        0.5 * math.sqrt(5.0) * x * y * (7.0 * z2 - q),
        0.25 * math.sqrt(10.0) * y * z * (7.0 * z2 - 3.0 * q),
        0.125 * (35.0 * z2 * z2 - 30.0 * z2 * q + 3.0 * q * q),
        0.25 * math.sqrt(10.0) * x * z * (7.0 * z2 - 3.0 * q),
        0.25 * math.sqrt(5.0) * d2 * (7.0 * z2 - q),
        0.25 * math.sqrt(70.0) * x * z * (x * x - 3.0 * y * y),
        0.125 * math.sqrt(35.0) * (x**4 - 6.0 * x * x * y * y + y**4),
    ]


def moment_basis(
    rr: Tensor,
    diff: Tensor,
    sw: Tensor,
    radial_std: Tensor,
    valid: Tensor,
    lmax: int,
    protection: float,
) -> Tensor:
    """(…, (lmax+1)²): ``rr`` (…, 4) then the degree 2..lmax blocks. ``diff`` (…, 3), ``sw``
    and ``radial_std`` (…, 1), ``valid`` (…) bool (real, not excluded neighbours)."""
    if lmax == 1:
        return rr
    r2 = (diff * diff).sum(dim=-1, keepdim=True)
    keep = valid.unsqueeze(-1) & (r2 > 0.0)
    safe_r = torch.sqrt(torch.where(r2 > 0.0, r2, torch.ones_like(r2)))
    denom = torch.where(keep, safe_r + protection, torch.ones_like(safe_r))
    keep_f = keep.to(diff.dtype)
    n = diff / denom * keep_f
    radial = sw / denom / radial_std * keep_f
    x, y, z = n[..., 0], n[..., 1], n[..., 2]
    q = x * x + y * y + z * z
    blocks = [rr, radial * torch.stack(_degree2(x, y, z, q), dim=-1)]
    if lmax >= 3:
        blocks.append(radial * torch.stack(_degree3(x, y, z, q), dim=-1))
    if lmax >= 4:
        blocks.append(radial * torch.stack(_degree4(x, y, z, q), dim=-1))
    return torch.cat(blocks, dim=-1)


def degree_weights(gain_raw: Tensor, lmax: int) -> Tensor:
    """((lmax+1)²,): 1 on the first four columns, ``g_l²`` on degree l's ``2l+1``."""
    blocks = [gain_raw.new_ones(4)]
    for degree in range(2, lmax + 1):
        g = gain_raw[degree - 2]
        blocks.append((g * g).expand(2 * degree + 1))
    return torch.cat(blocks)
