"""The many-rows path of a 4-bit layer on a CPU (node_agent/model/csrc/int4_matmul.cpp): torch's int4
kernel (`_weight_int4pack_mm_for_cpu`) is a matrix-vector kernel that re-reads and re-dequantises
every weight for each 4 rows, so a batch of decode rows, a prefill chunk or speculation's verify
step costs it about one pass over the weights per 4 rows. `cortex::int4_tiled_matmul` dequantises
the same packed weights once a call, a tile of output channels at a time into float32 kept in the
core's cache, and multiplies all the rows by each tile with oneDNN's GEMM: no resident copy of the
weights in a wider type. On a 2-core AVX2 EPYC it is 1.3-2x faster than the int4 kernel from 4 rows
up and 1.1-1.9x faster than the packed float32 GEMM (docs/benchmarks.md, issue 50); below 4 rows
the int4 kernel stays (at 1 and 2 rows it equals or beats the tiles on the larger layers).

Torch packs the codes for the kernel of this CPU's instruction set (blocks of 64 output channels
with AVX-512, 32 otherwise; whole blocks split in halves where vectorised): the layout is found once
a process by dequantising a probe and comparing it with its codes. Where none matches, or the
node's C++ kernels are not built, every row count runs torch's int4 kernel."""

import functools
import logging

import torch

from node_agent.model import cpu_kernels

log = logging.getLogger(__name__)

TILED_FROM_ROWS = 4  # rows from which the tiles beat torch's int4 kernel (measured, all shapes)
_LAYOUTS = ((64, True), (32, True), (32, False), (64, False))  # torch's (block_n, split_halves)


def tiled(rows: int, device: torch.device) -> bool:
    """Whether a 4-bit layer's call with `rows` rows on `device` runs the tiles (a function of the
    call's shape only)."""
    return device.type == "cpu" and rows >= TILED_FROM_ROWS and layout() is not None


@functools.cache
def layout() -> tuple[int, bool] | None:
    """Torch's int4 packing on this CPU as (block_n, split_halves), or None where the tiles cannot run."""
    if not cpu_kernels.load():
        return None
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


def matmul(
    flat: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """`flat` [rows, in] times an Int4Linear's packed weights, by the tiles: [rows, out]. The input
    and the output are rounded to bfloat16 as torch's kernel takes and returns them, so that a row's
    result does not depend on how many rows are beside it beyond float32's summation order."""
    rounded = flat.to(torch.bfloat16).float()
    return torch.ops.cortex.int4_tiled_matmul(
        rounded, packed, scales_and_zeros, group, *layout()
    ).to(torch.bfloat16)
