"""One GGUF tensor, as its raw blocks, into what the model holds: a quantized Linear layer
(node_agent/model/quantized_linear.py) or a dense tensor.

- Q4_0 (`d * (q - 8)`), Q4_1 (`d * q + m`) and Q4_K (`d * sc * q - dmin * m` per sub-block of 32)
  are affine groups of 32 four-bit codes: they map onto `Int4Linear` code for code, with only
  their scales rounded to bfloat16 (the kernels' dtype).
- Q8_0 (`d * q`, 32 eight-bit codes a block) maps onto `Int8GroupLinear` code for code, its scales
  rounded to bfloat16 (a layer whose shape the int4 kernels do not take: per channel, as below).
- Q6_K and Q8_K are dequantised and rounded per output channel to `Int8Linear`; every
  other quantized type (Q5_K, Q5_0/1, Q2_K, Q3_K, the IQ types) to `Int4Linear` groups (a
  measured error: docs/operations.md). shared/weight_formats.py holds this table.
- Dense types (F32, F16, BF16) and every tensor that is not a Linear weight (norms, embeddings)
  come out dense, dequantised where the file quantized them."""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, dequantize
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from node_agent.model.linear_shards import WHOLE, Shard
from node_agent.model.quantized_linear import Int4Linear, Int8GroupLinear, Int8Linear, fits_int4
from shared.weight_formats import EXACT_INT4_TYPES, EXACT_INT8_TYPES, gguf_layout


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 in the last two bytes of `raw` [..., 2] as float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes [..., 16] into 32 codes [..., 32]: low nibbles first, then high (Q4_0/Q4_1)."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def int4_groups(raw: np.ndarray, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K tensor's rows of blocks [rows, bytes] as codes [rows, cols] (0..15) and
    per group of 32 a scale and a low end [rows, cols / 32]: `w = scale * code + low`."""
    rows = raw.shape[0]
    data = torch.from_numpy(np.ascontiguousarray(raw))
    if qtype == T.Q4_K:
        blocks = data.view(
            -1, 144
        )  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes
        sc, mins = (
            torch.from_numpy(a.astype(np.float32))
            for a in Q4_K.get_scale_min(blocks[:, 4:16].numpy())
        )
        packed = blocks[:, 16:].view(
            -1, 4, 1, 32
        )  # sub-block 2j: low nibbles of bytes 32j.., 2j+1: high
        codes = torch.cat([packed & 0xF, packed >> 4], dim=2).view(rows, -1)
        scale = _half(blocks[:, 0:2])[:, None] * sc
        low = -_half(blocks[:, 2:4])[:, None] * mins
        return codes, scale.view(rows, -1), low.view(rows, -1)
    size = {T.Q4_0: 18, T.Q4_1: 20}[qtype]
    blocks = data.view(rows, -1, size)
    scale = _half(blocks[..., 0:2])
    if qtype == T.Q4_0:
        return _nibbles(blocks[..., 2:]).view(rows, -1), scale, -8 * scale
    return _nibbles(blocks[..., 4:]).view(rows, -1), scale, _half(blocks[..., 2:4])


def int8_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's rows of blocks [rows, bytes] (a float16 scale, then 32 signed bytes) as codes
    [rows, cols] (-128..127) and a scale per group of 32 [rows, cols / 32]: `w = scale * code`."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, 34)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), _half(blocks[..., 0:2])


def dense(raw: np.ndarray, qtype: T, dtype: torch.dtype) -> torch.Tensor:
    """The tensor at full precision, in `dtype`."""
    values = raw if gguf_layout(qtype.name) == "dense" else dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def linear(
    raw: np.ndarray, qtype: T, device: torch.device, shard: Shard = WHOLE
) -> Int4Linear | Int8GroupLinear | Int8Linear | None:
    """A quantized Linear weight [out, in] (bias set later) as the layer that runs `shard` of it on
    `device` (each device's kernel has its own packing; the whole layer is rounded before it is cut,
    so each rank's part is what one device holds of it); None for a 4-bit layout the int4 kernels
    do not take in this shape (it loads dense)."""
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    out_features, in_features = raw.shape[0], raw.shape[1] // block_bytes * block_elements
    if gguf_layout(qtype.name) == "int4" and not fits_int4(out_features, in_features):
        return None
    if qtype.name in EXACT_INT4_TYPES:
        codes, scale, low = int4_groups(raw, qtype)
        return Int4Linear(*(t.to(device) for t in shard.int4(codes, scale, low + 8 * scale)), None)
    if qtype.name in EXACT_INT8_TYPES and fits_int4(out_features, in_features):
        return Int8GroupLinear(*(t.to(device) for t in shard.int8_groups(*int8_groups(raw))), None)
    weight = dense(raw, qtype, torch.float32).to(device)
    return (Int4Linear if gguf_layout(qtype.name) == "int4" else Int8Linear).quantize(
        weight, shard=shard
    )
