"""A CPU model's RMSNorms, gated MLPs and attention projections with fewer calls a step, where
their forward is Llama's line for line (transformers' modular files copy it into most
architectures; the others, such as Gemma's 1 + weight norm or Olmo's order of operations, stay as
they are), and for the query, key and value projections wherever all three are plain Linear layers
(or 4-bit layers whose packings join) over one input.

A decode step is a few rows: each call's fixed cost (Python, dispatch, oneDNN's ~25 µs a matmul)
is much of a step for a small model. transformers' RMSNorm runs its seven tensor ops (float32
cast, pow, mean, add, rsqrt, two muls) one by one from Python, twice a layer: 35-50 µs a call
here, against 20 for ATen's `rms_norm`, which runs the same arithmetic from C++ and gives the
same numbers. A gated MLP's gate and up projections read the same input: one matmul over their
stacked weights does both (equal within float rounding, as any change of matmul blocking). So do
an attention's query, key and value projections: transformers calls them one after another on the
same hidden states, so the first call runs one matmul over the three stacked weights and the other
two take their parts of it (on a 2-vCPU AVX2 host a decode row's three packed calls took 69 + 49 +
49 µs with their weights in cache, most of it each call's fixed cost; a decode step of the default
model 57.7 -> 52.8 ms at one row, docs/benchmarks.md)."""

import functools
import inspect

import torch
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from node_agent.model import quantized_linear


class FusedRMSNorm(torch.nn.Module):
    """`weight * x / sqrt(mean(x²) + eps)`, computed in float32 and cast back before the weight,
    as transformers' Llama RMSNorm does."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.nn.functional.rms_norm(
                hidden_states, self.shape, self.weight, self.variance_epsilon
            )
        normed = torch.nn.functional.rms_norm(
            hidden_states.float(), self.shape, None, self.variance_epsilon
        )
        return self.weight * normed.to(hidden_states.dtype)


def stackable(layers: list[torch.nn.Module]) -> bool:
    """Whether layers over one input can be one (`_stacked`): plain Linear layers of one width,
    biased alike, in one dtype, or 4-bit layers whose packings join (quantized_linear.stackable);
    other quantized layers keep their own kernels."""
    if all(type(layer) is torch.nn.Linear for layer in layers):
        return (
            len({(layer.in_features, layer.bias is None, layer.weight.dtype) for layer in layers})
            == 1
        )
    return quantized_linear.stackable(layers)


def _stacked(layers: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer over the same input as `layers` (`stackable`), their weights stacked in order: its
    output is theirs side by side."""
    if type(layers[0]) is quantized_linear.Int4Linear:
        return quantized_linear.Int4Linear.stacked(layers)
    first = layers[0]
    stacked = torch.nn.Linear(
        first.in_features,
        sum(layer.out_features for layer in layers),
        bias=first.bias is not None,
        dtype=first.weight.dtype,
        device=first.weight.device,
    )
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([layer.weight for layer in layers]))
        if first.bias is not None:
            stacked.bias.copy_(torch.cat([layer.bias for layer in layers]))
    return stacked


class FusedMLP(torch.nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up as one Linear layer over their stacked weights."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.width = mlp.gate_proj.out_features
        self.gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.width, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class StackedProjections(torch.nn.Module):
    """Several Linear layers over one input as one Linear over their stacked weights: `part(i, x)`
    is layer i's output for `x`, all of them computed by one matmul for the input seen last (the
    parts are views of its output)."""

    def __init__(self, layers: list[torch.nn.Linear]):
        super().__init__()
        self.widths = [layer.out_features for layer in layers]
        self.stacked = _stacked(layers)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s output for `x`: the stacked matmul runs for the first layer's call, or when
        `x` is not the input whose parts are held; the parts are let go once each has been taken."""
        if index == 0 or x is not self._input:
            self._input, self._parts, self._taken = x, self.stacked(x).split(self.widths, dim=-1), 0
        out = self._parts[index]
        self._taken += 1
        if self._taken == len(self.widths):
            self._input, self._parts = None, ()
        return out


class ProjectionPart(torch.nn.Module):
    """One of the layers a StackedProjections holds, where the model calls it (its own name)."""

    def __init__(self, stack: StackedProjections, index: int):
        super().__init__()
        self.index, self.out_features, self.in_features = (
            index,
            stack.widths[index],
            stack.stacked.in_features,
        )
        self._stack = (stack,)  # not a submodule here: the attention module owns it (`qkv_proj`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stack[0].part(self.index, x)


def _stack_qkv(attention: torch.nn.Module) -> bool:
    """Replace `attention`'s q_proj, k_proj and v_proj by parts of one StackedProjections (its
    `qkv_proj`) where the three can be one layer (`stackable`)."""
    layers = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(layer, torch.nn.Module) for layer in layers) or not stackable(layers):
        return False
    stack = StackedProjections(layers)
    attention.qkv_proj = stack
    for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
        setattr(attention, name, ProjectionPart(stack, index))
    return True


@functools.cache
def _forward_is(cls: type, reference: type) -> bool:
    forward = getattr(cls, "forward", None) if issubclass(cls, torch.nn.Module) else None
    try:
        return forward is not None and inspect.getsource(forward) == inspect.getsource(
            reference.forward
        )
    except (OSError, TypeError):  # no source to compare: leave it
        return False


def _fused(module: torch.nn.Module) -> torch.nn.Module | None:
    if _forward_is(type(module), LlamaRMSNorm):
        return FusedRMSNorm(module)
    if _forward_is(type(module), LlamaMLP) and stackable([module.gate_proj, module.up_proj]):
        return FusedMLP(module)
    return None


def fuse(model: torch.nn.Module) -> int:
    """Replace, in place, every RMSNorm and gated MLP whose forward is Llama's by its fused
    equivalent, and stack every attention's query, key and value projections (before the Linear
    layers are packed: a stacked projection is packed as one); returns how many."""
    count = 0
    for parent in list(model.modules()):
        count += _stack_qkv(parent)
        for name, child in list(parent.named_children()):
            if (fused := _fused(child)) is not None:
                setattr(parent, name, fused)
                count += 1
    return count
