"""Rotary position embeddings (HF's rotate-half convention) and the scaling variants of real checkpoints.

``rope`` is config.json's ``rope_parameters`` as transformers >= 5 normalises it
(``rope_type``, ``rope_theta``, and the variant's own keys). A variant gives inverse frequencies,
an attention factor that scales cos and sin (YaRN, LongRoPE), and for LongRoPE a second set of
frequencies used from ``original_max_position_embeddings`` on:

    position:  0 .. original_max - 1  | original_max .. max_positions - 1
    LongRoPE:  short_factor           | long_factor

HF switches LongRoPE's set per forward pass by the pass's longest position; for a token
generated at position p that is exactly the rule above. Only a *prompt* longer than
original_max differs (HF rotates all its tokens with the long set); see docs/serving.md, "Rotary scaling".
Dynamic NTK is the plain rotation while the context stays within max_position_embeddings,
and HF re-derives it per length beyond that, which a paged cache cannot follow: refused there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pdserve.kernels import cpu_ext


@dataclasses.dataclass(frozen=True, slots=True)
class RotaryFrequencies:
    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    long_inv_freq: torch.Tensor | None  # [rotary_dim / 2]: LongRoPE's set for positions >= switch_position
    switch_position: int | None  # first position rotated with long_inv_freq
    attention_factor: float  # multiplies cos and sin


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rotary_frequencies(
    dim: int, rope: dict, max_positions: int, max_position_embeddings: int
) -> RotaryFrequencies:
    """Frequencies of a rotary dimension ``dim`` for the variant ``rope["rope_type"]``."""
    kind, theta = rope.get("rope_type", "default"), float(rope["rope_theta"])
    plain = _base_inv_freq(dim, theta)
    if kind == "default":
        return RotaryFrequencies(plain, None, None, 1.0)
    if kind == "linear":
        return RotaryFrequencies(plain / rope["factor"], None, None, 1.0)
    if kind == "llama3":
        return RotaryFrequencies(_llama3_scale(plain, rope), None, None, 1.0)
    if kind == "dynamic":
        if max_positions > max_position_embeddings:
            raise ValueError(
                f"rope_type 'dynamic': a context of {max_positions} tokens exceeds "
                f"max_position_embeddings={max_position_embeddings}, past which HF re-derives the "
                "frequencies per sequence length; pass max_model_len <= max_position_embeddings"
            )
        return RotaryFrequencies(plain, None, None, 1.0)
    if kind == "yarn":
        return _yarn(dim, theta, rope, max_position_embeddings)
    if kind == "longrope":
        return _longrope(dim, theta, rope, max_position_embeddings)
    raise ValueError(
        f"rope_type {kind!r} is not supported (supported: default, linear, llama3, dynamic, yarn, longrope)"
    )


def _llama3_scale(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, rope: dict, max_position_embeddings: int) -> RotaryFrequencies:
    # Interpolate (divide by factor) the low frequencies, keep the high ones, ramp between.
    old_len = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / old_len
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else _yarn_mscale(factor)
        )

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return RotaryFrequencies(inv_freq, None, None, float(attention_factor))


def _longrope(dim: int, theta: float, rope: dict, max_position_embeddings: int) -> RotaryFrequencies:
    old_len = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / old_len
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * theta**exponents)
    long = 1.0 / (torch.tensor(rope["long_factor"], dtype=torch.float32) * theta**exponents)
    return RotaryFrequencies(short, long, old_len, float(attention_factor))


class RotaryEmbedding(torch.nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head (all of them unless partial rotary)."""

    def __init__(self, rotary_dim: int, max_positions: int, rope: dict, max_position_embeddings: int) -> None:
        super().__init__()
        f = rotary_frequencies(rotary_dim, rope, max_positions, max_position_embeddings)
        inv_freq = f.inv_freq[None, :].expand(max_positions, -1)  # [P, dim/2]
        if f.long_inv_freq is not None:
            assert f.switch_position is not None  # LongRoPE's two sets come with where they switch
            is_long = (torch.arange(max_positions) >= f.switch_position)[:, None]
            inv_freq = torch.where(is_long, f.long_inv_freq[None, :], inv_freq)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq  # [P, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
        self.rotary_dim = rotary_dim
        self.register_buffer("cos", emb.cos() * f.attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * f.attention_factor, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(bfloat16) would round the tables too. They stay fp32, as HF keeps them, and
        # follow only the device: forward rounds them to x's dtype, and the kernel reads fp32.
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def can_rotate_in_place(self, x: torch.Tensor) -> bool:
        """Whether ``rotate_`` takes ``x``: whole-head rotation of [T, heads, D] with heads packed,
        on CPU where the kernel runs (kernels/csrc/dense_cpu.cpp)."""
        return (
            self.rotary_dim == x.shape[-1]
            and x.device.type == "cpu"
            and x.stride(-1) == 1
            and x.stride(-2) == x.shape[-1]
            and cpu_ext.enabled()
        )

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """``forward``'s rotation, in place, in one pass (see can_rotate_in_place)."""
        cpu_ext.rotary_(x, positions, self.cos, self.sin)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, heads, D] (query and key heads side by side, rotated in one go)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        if self.rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
