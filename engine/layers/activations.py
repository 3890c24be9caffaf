"""The activation functions named by config.json's ``hidden_act`` / ``activation_function``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's name for the tanh form
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
        ) from None
