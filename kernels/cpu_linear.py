"""Linear layers on CPU through oneDNN with the weights packed once, at load time.

torch's CPU ``F.linear`` on fp32 calls MKL's sgemm, which on this project's AMD machines runs
2-4x slower than oneDNN's matmul on a weight already reordered into oneDNN's blocked layout
(bench/notes/engine-cpu.md, "Linear layers"; the LM head at batch 1: 7.3 ms against 2.4 ms). torch ships
both halves of that path as ops, the ones its inductor uses when it freezes a CPU model:
``mkldnn::_reorder_linear_weight`` packs a weight and ``mkldnn::_linear_pointwise`` runs the
matmul on it. ``pack_linears`` swaps every ``nn.Linear`` of a loaded model for a
``PackedLinear`` holding only the packed weight (and the bias).

The results are fp32 matmuls with another summation order: within fp32 rounding of F.linear,
not bit-equal. Where the ops are missing or refuse the dtype (fp16 needs AVX512-FP16), the model
keeps its plain layers after one warning line. ``PDSERVE_PACKED_LINEAR=0`` keeps them too.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W in oneDNN's layout. Inference only: the packed weight has no grad."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not buffers: a oneDNN tensor has no strides for .to() or state_dict.
        self.packed_weight = pack_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed_weight, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """A plain copy of the weight, [out, in], for inspection (forward never builds it)."""
        return self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout, for ``packed_matmul``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` with W packed by ``pack_weight``: x [..., in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def enabled(dtype: torch.dtype) -> bool:
    """Packing is wanted (PDSERVE_PACKED_LINEAR is not 0) and oneDNN runs ``dtype`` here."""
    return os.environ.get("PDSERVE_PACKED_LINEAR", "1") != "0" and _works(dtype)


_checked: dict[torch.dtype, bool] = {}


def _works(dtype: torch.dtype) -> bool:
    """One small packed matmul against F.linear: the ops exist, take the dtype and agree."""
    if dtype not in _checked:
        _checked[dtype] = _self_check(dtype)
    return _checked[dtype]


def _self_check(dtype: torch.dtype) -> bool:
    if dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        linear = nn.Linear(64, 48, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(48, 64, generator=gen))
        x = torch.randn(5, 64, generator=gen, dtype=torch.float32).to(dtype)
        with torch.inference_mode():
            got, want = PackedLinear(linear)(x).float(), linear(x).float()
        tol = 1e-4 if dtype == torch.float32 else 0.1
        if torch.allclose(got, want, rtol=tol, atol=tol):
            return True
        log.warning("packed linear layers disagree with F.linear in %s; using F.linear", dtype)
    except Exception as e:  # noqa: BLE001 - a missing op or refused dtype means the plain layers
        log.warning("packed linear layers unavailable in %s (%s); using F.linear", dtype, str(e)[:200])
    return False


def pack_linears(model: nn.Module, quantization: str | None = None, pack: bool = True) -> int:
    """Pack every linear layer of ``model`` (on CPU, loaded); how many were. An nn.Linear is
    replaced by a PackedLinear; a layer of engine/layers/linear.py (``packable``) packs its own
    weight, keeping its parallel sums and gathers. ``quantization="int8"``: those layers that are
    ``quantizable`` (all but the LM head) hold int8 weights instead (kernels/cpu_int8.py); plain
    nn.Linear layers (a model's small gates) stay in the compute dtype. ``pack=False``: only the
    int8 layers change (oneDNN does not pack this dtype); the rest keep F.linear.

    A tied LM head is packed from the embedding's weight, which the embedding keeps. Each plain
    weight is dropped as soon as its packed one replaces it: the model never holds its weights
    twice over (bar one layer).
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (type(child) is nn.Linear or getattr(child, "packable", False))
        and child.weight.device.type == "cpu"
    ]
    count = 0
    for parent, name, child in targets:
        if quantization == "int8" and getattr(child, "quantizable", False):
            child.quantize()  # type: ignore[operator]
        elif not pack:
            continue
        elif type(child) is nn.Linear:
            setattr(parent, name, PackedLinear(child))
        else:
            child.pack()  # type: ignore[operator]
        count += 1
    return count
