"""A 4-bit layer's matmul on a CPU by the node's kernel (node_agent/model/csrc/int4_matmul.cpp,
`cortex::int4_linear`), over the weights as torch's int4 kernel packed them, the path chosen by
the call's rows. Torch's kernel (`_weight_int4pack_mm_for_cpu`) is a matrix-vector one that
re-reads and re-dequantises every weight for each 4 rows, so a batch of decode rows, a prefill
chunk or speculation's verify step costs it about one pass over the weights per 4 rows. From
a number of rows (`kernel_args`) the tiles run instead: the same packed weights dequantised once a call, a
tile of output channels at a time into float32 kept in the core's cache, and all the rows
multiplied by each tile with oneDNN's GEMM; no resident copy of the weights in a wider type. From
128 rows (a prefill chunk) on a CPU with AMX, each tile runs as two bfloat16 GEMMs, over the
weights rounded to bfloat16 and over what that rounding left (float32's product within its
rounding: the activations are bfloat16's values already): 1.2-1.7x faster than one float32 GEMM
at 512 rows of SmolLM2's layers on a 2-core Xeon.

Where the tiles start was measured per layer shape (docs/benchmarks.md, issue 50): on a 2-core
AVX2 EPYC they beat torch's kernel from 2-4 rows; on a 2-core AVX-512 Xeon, whose torch kernel
(blocks of 64 channels) is about twice as fast a row, from 6-16 rows: 4 rows where torch packs
blocks of 32 channels (AVX2), 8 where it packs 64 (AVX-512).

Torch packs the codes for the kernel of this CPU's instruction set (blocks of 64 output channels
with AVX-512, 32 otherwise; whole blocks split in halves where vectorised): the layout is found once
a process by dequantising a probe and comparing it with its codes. Where none matches, or the
node's C++ kernels are not built, every row count runs torch's int4 kernel. A model's 4-bit layers
are bound to the kernel at load (`bind`), so that a compiled step calls the C++ operator itself
(no Python between Inductor and the kernel)."""

import functools
import logging

import torch

from node_agent.model import cpu_kernels

log = logging.getLogger(__name__)

_LAYOUTS = ((64, True), (32, True), (32, False), (64, False))  # torch's (block_n, split_halves)


@functools.cache
def layout() -> tuple[int, bool] | None:
    """Torch's int4 packing on this CPU as (block_n, split_halves), or None where the tiles cannot run."""
    if not cpu_kernels.load():
        return None
    torch.library.register_fake("cortex::int4_linear", _shape)  # its shape for compiled steps
    from node_agent.model.quantized_linear import GROUP, Int4Linear, round_int4

    probe = torch.randn(80, 2 * GROUP, generator=torch.Generator().manual_seed(0))
    codes, scale, zero = round_int4(probe)
    layer = Int4Linear(codes, scale, zero, None)
    eye = torch.eye(2 * GROUP)
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye.bfloat16(), layer.weight_packed, GROUP, layer.scales_and_zeros
    ).float()
    for candidate in _LAYOUTS:
        weights = torch.ops.cortex.int4_tiled_matmul(
            eye, layer.weight_packed, layer.scales_and_zeros, GROUP, *candidate
        )
        if torch.allclose(weights, expected, rtol=1e-2, atol=1e-2):
            return candidate
    log.warning(
        "4-bit layers run torch's int4 kernel at every row count: its packing on this CPU is not one the tiles read"
    )
    return None


def runs(device: torch.device) -> bool:
    """Whether a 4-bit layer's calls on `device` run the node's kernel."""
    return device.type == "cpu" and layout() is not None


def kernel_args() -> tuple[int, bool, int]:
    """`cortex::int4_linear`'s arguments after the group, for this CPU: torch's packing (block_n,
    split_halves) and the rows from which the tiles run."""
    block_n, split_halves = layout()
    return block_n, split_halves, 8 if block_n == 64 else 4


def matmul(
    flat: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group: int,
    kernel: tuple[int, bool, int],
) -> torch.Tensor:
    """`flat` [rows, in] (float32 or bfloat16) times an Int4Linear's packed weights by
    `cortex::int4_linear` with `kernel` (`kernel_args()`): [rows, out] in `flat`'s dtype. The input is
    rounded to bfloat16 as torch's kernel takes it, and the product to bfloat16's precision as torch's
    kernel gives it, so that a row's result does not depend on how many rows are beside it beyond
    float32's summation order."""
    return torch.ops.cortex.int4_linear(flat, packed, scales_and_zeros, group, *kernel)


def bind(model: torch.nn.Module) -> int:
    """Give each CPU 4-bit layer of `model` the kernel's arguments for this CPU, so that its calls (a
    compiled step's too) go straight to `cortex::int4_linear`; returns how many (none where the
    kernel cannot run)."""
    from node_agent.model.quantized_linear import Int4Linear

    if layout() is None:
        return 0
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Int4Linear) and m.weight_packed.device.type == "cpu"
    ]
    for layer in layers:
        layer.cpu_kernel = kernel_args()
    return len(layers)


def _shape(flat, packed, scales_and_zeros, group, block_n, split_halves, tiled_from_rows):
    return flat.new_empty((flat.shape[0], scales_and_zeros.shape[1]))
