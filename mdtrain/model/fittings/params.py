"""Frame and atomic parameters as inputs of a fitting (DeePMD-kit's ``GeneralFitting``):
``numb_fparam`` values per frame and ``numb_aparam`` per atom, each normalised with its
statistics, ``(x - avg) * inv_std``, and appended to every atom's descriptor row.

`ParamFitting` is the base of the energy fitting (`mdtrain.model.fitting.EnergyFitting`) and of
the nets of several outputs (`mdtrain.model.fittings.nets.TypeFittingNets`: DOS, property).
Its buffers (``fparam_avg``, ``fparam_inv_std``, ``aparam_avg``, ``aparam_inv_std``) exist
only when the fitting has such parameters, so a plain fitting keeps its state dict;
``default_fparam`` comes from the config and is not in the state dict.
"""

import torch
from torch import Tensor, nn


class ParamFitting(nn.Module):
    """The parameters' counts, statistics and `with_params`; ``dim_descrpt`` is the
    descriptor's width, ``dim_in`` the nets' (descriptor plus parameters)."""

    dim_descrpt: int
    dim_in: int
    numb_fparam: int
    numb_aparam: int

    def init_params(
        self,
        dim_descrpt: int,
        numb_fparam: int = 0,
        numb_aparam: int = 0,
        default_fparam: list[float] | None = None,
    ) -> None:
        """Set the counts and widths and register the statistics buffers (call once, in
        ``__init__``, before building the nets of ``dim_in`` inputs)."""
        self.dim_descrpt = int(dim_descrpt)
        self.numb_fparam = int(numb_fparam)
        self.numb_aparam = int(numb_aparam)
        self.dim_in = self.dim_descrpt + self.numb_fparam + self.numb_aparam
        f64 = torch.float64
        if self.numb_fparam > 0:
            self.register_buffer("fparam_avg", torch.zeros(self.numb_fparam, dtype=f64))
            self.register_buffer("fparam_inv_std", torch.ones(self.numb_fparam, dtype=f64))
            if default_fparam is not None:
                default = torch.tensor([float(v) for v in default_fparam], dtype=f64)
                # from the config, so not in the state dict (checkpoints, .dp files)
                self.register_buffer("default_fparam", default, persistent=False)
        if self.numb_aparam > 0:
            self.register_buffer("aparam_avg", torch.zeros(self.numb_aparam, dtype=f64))
            self.register_buffer("aparam_inv_std", torch.ones(self.numb_aparam, dtype=f64))

    def with_params(
        self, descriptor: Tensor, fparam: Tensor | None, aparam: Tensor | None
    ) -> Tensor:
        """D (nf, N, dim_descrpt) with the normalised frame and atomic parameters appended."""
        nf, natoms = descriptor.shape[0], descriptor.shape[1]
        parts = [descriptor]
        if hasattr(self, "fparam_avg"):
            if fparam is None:
                if hasattr(self, "default_fparam"):
                    fparam = self.default_fparam.unsqueeze(0).expand(nf, self.numb_fparam)
                else:
                    raise RuntimeError("this model needs frame parameters (fparam)")
            fp = (fparam.reshape(nf, self.numb_fparam).to(torch.float64) - self.fparam_avg) * (
                self.fparam_inv_std
            )
            fp = fp.unsqueeze(1).expand(nf, natoms, self.numb_fparam)
            parts.append(fp.to(descriptor.dtype))
        if hasattr(self, "aparam_avg"):
            if aparam is None:
                raise RuntimeError("this model needs atomic parameters (aparam)")
            ap = aparam.reshape(nf, natoms, self.numb_aparam).to(torch.float64)
            ap = (ap - self.aparam_avg) * self.aparam_inv_std
            parts.append(ap.to(descriptor.dtype))
        if len(parts) == 1:
            return descriptor
        return torch.cat(parts, dim=-1)
