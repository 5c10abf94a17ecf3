"""A CPU model's RMSNorms and gated MLPs with fewer calls a step, where their forward is Llama's
line for line (transformers' modular files copy it into most architectures; the others, such as
Gemma's 1 + weight norm or Olmo's order of operations, stay as they are).

A decode step is a few rows: each call's fixed cost (Python, dispatch, oneDNN's ~25 µs a matmul)
is much of a step for a small model. transformers' RMSNorm runs its seven tensor ops (float32
cast, pow, mean, add, rsqrt, two muls) one by one from Python, twice a layer: 35-50 µs a call
here, against 20 for ATen's `rms_norm`, which runs the same arithmetic from C++ and gives the
same numbers. A gated MLP's gate and up projections read the same input: one matmul over their
stacked weights does both (equal within float rounding, as any change of matmul blocking)."""

import functools
import inspect

import torch
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm


class FusedRMSNorm(torch.nn.Module):
    """`weight * x / sqrt(mean(x²) + eps)`, computed in float32 and cast back before the weight,
    as transformers' Llama RMSNorm does."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.nn.functional.rms_norm(hidden_states, self.shape, self.weight, self.variance_epsilon)
        normed = torch.nn.functional.rms_norm(hidden_states.float(), self.shape, None, self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


class FusedMLP(torch.nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up as one Linear layer over their stacked weights."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.width = gate.out_features
        self.gate_up = torch.nn.Linear(gate.in_features, 2 * self.width, bias=gate.bias is not None,
                                       dtype=gate.weight.dtype, device=gate.weight.device)
        with torch.no_grad():
            self.gate_up.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                self.gate_up.bias.copy_(torch.cat([gate.bias, up.bias]))
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.width, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


@functools.cache
def _forward_is(cls: type, reference: type) -> bool:
    forward = getattr(cls, "forward", None) if issubclass(cls, torch.nn.Module) else None
    try:
        return forward is not None and inspect.getsource(forward) == inspect.getsource(reference.forward)
    except (OSError, TypeError):  # no source to compare: leave it
        return False


def _fused(module: torch.nn.Module) -> torch.nn.Module | None:
    if _forward_is(type(module), LlamaRMSNorm):
        return FusedRMSNorm(module)
    if _forward_is(type(module), LlamaMLP) and type(module.gate_proj) is type(module.up_proj) is torch.nn.Linear:
        return FusedMLP(module)  # full-precision projections only: quantized layers keep their own kernels
    return None


def fuse(model: torch.nn.Module) -> int:
    """Replace, in place, every RMSNorm and gated MLP whose forward is Llama's by its fused
    equivalent (before the Linear layers are packed: the stacked projection is packed as one);
    returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (fused := _fused(child)) is not None:
                setattr(parent, name, fused)
                count += 1
    return count
