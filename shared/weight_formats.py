"""How each stored weight format runs on a node, and what it then holds: the one table the node's
GGUF loader (node_agent/model/gguf_weights.py) and placement's estimate (shared/memory.py) share.
No torch here, so the gateway can read it."""

from typing import Literal, NamedTuple

Layout = Literal["dense", "int4", "int8"]

DENSE_TYPES = {"F32", "F16", "BF16"}  # GGUF tensor types held at full precision
EXACT_INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}  # affine groups of 32 four-bit codes: mapped code for code
INT8_TYPES = {"Q8_0", "Q6_K", "Q8_K"}  # rounded per output channel to 8 bits; other quantized types to 4-bit groups
GROUP = 32  # inputs per 4-bit group
# A 4-bit layer: half a byte a weight, and a bfloat16 scale and zero per group. An 8-bit one: a byte
# a weight (and one bfloat16 scale per output channel, left out).
BYTES_PER_WEIGHT = {"int4": 0.5 + 2 * 2 / GROUP, "int8": 1.0}


class StoredTensor(NamedTuple):
    name: str
    elements: int
    dims: int
    gguf_type: str = ""  # the GGML type's name; "" in a safetensors checkpoint


def gguf_layout(gguf_type: str) -> Layout:
    """How a GGUF Linear weight of this type runs under quant = "auto"."""
    if gguf_type in DENSE_TYPES:
        return "dense"
    return "int8" if gguf_type in INT8_TYPES else "int4"


def _is_head_or_embedding(name: str) -> bool:
    return any(part in name for part in ("embed", "lm_head", "token_embd", "output.weight", "wte"))


def layout(tensor: StoredTensor, quant: str, tensor_parallel: int = 1) -> Layout:
    """How a node holds `tensor` under the catalogue's `quant`: Linear weights (2-D, neither the
    embedding nor the output head) quantized as the node quantizes them, the rest dense."""
    if tensor.dims != 2 or tensor_parallel > 1:
        return "dense"
    if quant == "auto":
        return gguf_layout(tensor.gguf_type) if tensor.gguf_type and tensor.name != "token_embd.weight" else "dense"
    if quant in BYTES_PER_WEIGHT and not _is_head_or_embedding(tensor.name):
        return quant
    return "dense"


def weight_bytes(tensors: list[StoredTensor], quant: str, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """What the weights hold on a node's device(s)."""
    total = 0.0
    for tensor in tensors:
        held = layout(tensor, quant, tensor_parallel)
        total += tensor.elements * (dtype_bytes if held == "dense" else BYTES_PER_WEIGHT[held])
    return int(total)
