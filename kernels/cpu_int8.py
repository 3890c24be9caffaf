"""W8A8 linear layers on the CPU: int8 weights quantized as they load, int8 activations quantized
per token as they arrive, int32 sums in oneDNN's int8 matmul (AVX512-VNNI, AMX-INT8 or AVX2,
whichever oneDNN finds on the machine).

    weights       per output channel, symmetric: s_w[n] = max|W[n, :]| / 127, Wq = round(W / s_w)
                  in [-127, 127]; packed once into oneDNN's blocked layout (``qlinear_prepack``)
    activations   per token, symmetric: s_x[t] = max|x[t, :]| / 127, xq = round(x / s_x); handed
                  to oneDNN as uint8 xq + 128 with zero point 128, as VNNI multiplies u8 by s8
    output        y[t, n] = (sum_k xq[t, k] Wq[n, k]) * s_w[n] * s_x[t] + b[n], in fp32, rounded
                  once to the model's dtype

No calibration data: every scale comes from the weights or from the token itself, so a request's
output does not depend on which other requests share its step (the int32 sums are exact in any
order). oneDNN applies s_w; the row scale and the bias follow in one pass
(kernels/csrc/dense_cpu.cpp ``dequantize_rows``), with the activations' quantization the other
native op (``quantize_rows_u8``); both have torch fallbacks that give the same values.

Accuracy against float32 is measured, not assumed: bench/accuracy.py, bench/README.md.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.kernels import cpu_ext

QMAX = 127
ZERO_POINT = 128  # the activations' offset into uint8


@dataclasses.dataclass(frozen=True, slots=True)
class Int8Weight:
    """A weight [out, in] as int8 per output channel, packed for oneDNN, with its scales."""

    packed: torch.Tensor  # oneDNN's blocked int8 layout (no strides: never .to() or state_dict it)
    scale: torch.Tensor  # [out] fp32: W[n, :] ~ Wq[n, :] * scale[n]
    zero_points: torch.Tensor  # [out] int64 zeros (symmetric), as the op takes them
    in_features: int
    out_features: int


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] any float dtype -> (int8 [out, in], fp32 scales [out]), per output channel,
    symmetric, round half to even. An all-zero row: zeros and scale 0."""
    q, scale = _symmetric_rows(weight.detach().float())
    return q.to(torch.int8), scale[:, 0]


def _symmetric_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, K] -> (each row's integers in [-127, 127], as fp32; its scale [R, 1])."""
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = amax / QMAX
    q = torch.where(amax > 0, torch.round(rows / scale.clamp_min(torch.finfo(torch.float32).tiny)), 0)
    return q.clamp_(-QMAX, QMAX), scale


def pack_weight(weight: torch.Tensor) -> Int8Weight:
    q, scale = quantize_weight(weight)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    zeros = torch.zeros(q.shape[0], dtype=torch.int64, device="cpu")
    return Int8Weight(packed, scale, zeros, q.shape[1], q.shape[0])


def quantize_rows(x: torch.Tensor, native: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] -> (uint8 [T, K], fp32 [T, 1]): each row's int8 plus ZERO_POINT, and its scale."""
    if native is None:
        native = cpu_ext.enabled()
    if native:
        return cpu_ext.quantize_rows_u8(x)
    q, scale = _symmetric_rows(x.float())
    return (q + ZERO_POINT).to(torch.uint8), scale


def dequantize_rows(
    acc: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    native: bool | None = None,
) -> torch.Tensor:
    """acc [T, N] fp32 * scale [T, 1] (+ bias [N]), rounded to ``dtype``."""
    if native is None:
        native = cpu_ext.enabled()
    if native:
        return cpu_ext.dequantize_rows(acc, scale, bias, dtype)
    y = acc * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def int8_matmul(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` in W8A8: x [..., in] (any float dtype) -> [..., out] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    q, scale = quantize_rows(flat)
    acc = torch.ops.onednn.qlinear_pointwise(
        q, 1.0, ZERO_POINT, weight.packed, weight.scale, weight.zero_points,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip
    out = dequantize_rows(acc, scale, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.out_features)


def reference_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``int8_matmul`` computes, in plain float32 torch: the weight and the activations
    quantized and dequantized the same way (fake quantization), then F.linear: what the
    self-check holds oneDNN's result to. (The tests build their own simulation.)"""
    q, s_w = quantize_weight(weight)
    xq, s_x = quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), native=False)
    w_hat = q.float() * s_w[:, None]
    x_hat = (xq.float() - ZERO_POINT) * s_x
    y = torch.nn.functional.linear(x_hat, w_hat, None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


_checked: bool | None = None


def available() -> str | None:
    """None where oneDNN's int8 matmul runs here and agrees with the reference; else why not."""
    global _checked
    if _checked is None:
        _checked = _self_check()
    return None if _checked else _why_not


_why_not = "oneDNN's int8 matmul (torch.ops.onednn.qlinear_pointwise) is not in this torch"


def _self_check() -> bool:
    global _why_not
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=gen, device="cpu")
        x = torch.randn(5, 64, generator=gen, device="cpu")
        with torch.inference_mode():
            got = int8_matmul(x, pack_weight(weight), None)
            want = reference_matmul(x, weight, None)
        if torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            return True
        _why_not = "oneDNN's int8 matmul disagrees with its reference on this machine"
    except Exception as e:  # noqa: BLE001 - a missing op or refused layout: no int8 here
        _why_not = f"oneDNN's int8 matmul failed here ({str(e)[:200]})"
    return False
