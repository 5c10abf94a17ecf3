"""Which kernels a loaded model's matmuls run, in words for operators (`cortex status`, `/v1/models`,
the dashboard; `ModelInfo.kernels`): one phrase per kind of layer it holds, the output head's own
when it differs from the rest, e.g. "int4: torch's int4 kernel below 4 rows, the node's tiles from
4 (AVX2 packing); head: the node's 8-bit groups". The decode step's kind (eager, compiled, CUDA
graphs) is the runner's and is added where the engine reports it."""

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from node_agent.model.int8_groups_cpu import CpuInt8GroupLinear
from node_agent.model.packed_linear import PackedLinear
from node_agent.model.quantized_linear import (
    Float8Linear,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
)


def describe(model: torch.nn.Module) -> str:
    """The kernels of `model`'s Linear layers (those inside 8-bit groups counted as their group)."""
    head = model.get_output_embeddings()
    halves = {
        id(half)
        for m in model.modules()
        if isinstance(m, Int8GroupLinear)
        for half in (m.high, m.low)
    }
    layers = {
        _kernel(m)
        for m in model.modules()
        if m is not head and id(m) not in halves and _kernel(m) is not None
    }
    phrases = sorted(layers)
    own = _kernel(head) if head is not None else None
    if own is not None and own not in layers:
        phrases.append(f"head: {own}")
    return "; ".join(phrases)


def _kernel(layer: torch.nn.Module) -> str | None:
    """What one layer's matmul runs (None: not a Linear layer)."""
    if isinstance(layer, Int4Linear):
        return _int4(layer)
    if isinstance(layer, Int8GroupLinear):
        return f"8-bit groups as two 4-bit halves ({_int4(layer.high)})"
    if isinstance(layer, CpuInt8GroupLinear):
        return "the node's 8-bit groups (few rows in registers, more through oneDNN tiles)"
    if isinstance(layer, Int8Linear):
        return "int8: ATen's weight-only int8 kernel"
    if isinstance(layer, Float8Linear):
        return "fp8: torch._scaled_mm, rows scaled on the device"
    if isinstance(layer, PackedLinear):
        return f"{_dtype(layer.weight)}: oneDNN over packed weights"
    if isinstance(layer, DynamicInt8Linear):  # a CPU's "int8" and "fp8" (torch.ao's)
        return "int8: ATen's dynamic int8 (activations quantized per call)"
    if isinstance(layer, torch.nn.Linear):
        library = "cuBLAS" if layer.weight.is_cuda else "ATen"
        return f"{_dtype(layer.weight)}: {library}"
    return None


def _int4(layer: Int4Linear) -> str:
    if layer.weight_packed.is_cuda:
        return "int4: torch's tinygemm"
    if layer.cpu_kernel is None:
        return "int4: torch's int4 kernel"
    block_n, _, tiled_from = layer.cpu_kernel
    packing = "AVX-512" if block_n == 64 else "AVX2"
    return (
        f"int4: torch's int4 kernel below {tiled_from} rows, the node's tiles from {tiled_from} "
        f"({packing} packing)"
    )


def _dtype(weight: torch.Tensor) -> str:
    return str(weight.dtype).removeprefix("torch.")
