"""Feed-forward blocks: the gated MLP (SwiGLU / GeGLU) with gate and up fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.activations import activation
from pdserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.kernels import cpu_ext


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); ``gate_up_proj`` holds gate's rows, then up's (this rank's
    share of each), and ``down_proj`` sums the ranks' outputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, parallel, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, bias=bias)
        self.act = activation(act)
        self.is_silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        if self.is_silu and x.device.type == "cpu" and cpu_ext.enabled():
            return self.down_proj(cpu_ext.silu_mul(self.gate_up_proj(x)))  # one pass, no [T, I] temporaries
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)
