"""How each stored weight format runs on a node, and what it then holds: the one table the node's
loaders (node_agent/model/gguf_weights.py, checkpoint_weights.py) and placement's estimate
(shared/memory.py) share. No torch here, so the gateway can read it."""

from typing import Literal, NamedTuple

Layout = Literal["dense", "int4", "int8", "int8-groups", "fp8"]

DENSE_TYPES = {"F32", "F16", "BF16"}  # GGUF tensor types held at full precision
EXACT_INT4_TYPES = {
    "Q4_0",
    "Q4_1",
    "Q4_K",
}  # affine groups of 32 four-bit codes: mapped code for code
EXACT_INT8_TYPES = {"Q8_0"}  # groups of 32 eight-bit codes, one scale each: mapped code for code
INT8_TYPES = {
    "Q6_K",
    "Q8_K",
}  # rounded per output channel to 8 bits; other quantized types to 4-bit groups
GROUP = 32  # inputs per 4-bit group
OUT_MULTIPLE = 16  # the int4 kernels pack output rows in tiles of 16 (CPU) / 8 (tinygemm)
# A 4-bit layer: half a byte a weight, and a bfloat16 scale and zero per group. An 8-bit one (integer
# or float8): a byte a weight (and one scale per output channel, left out). 8-bit groups run as two
# 4-bit layers (node_agent/model/quantized_linear.py: Int8GroupLinear).
BYTES_PER_WEIGHT = {
    "int4": 0.5 + 2 * 2 / GROUP,
    "int8": 1.0,
    "int8-groups": 2 * (0.5 + 2 * 2 / GROUP),
    "fp8": 1.0,
}

# Safetensors checkpoints quantized as config.json's `quantization_config` says, and how a node holds
# their quantized Linear weights under quant = "auto": AWQ's and GPTQ's 4-bit codes as 4-bit groups,
# FP8 (fine-grained "fp8", compressed-tensors' float8) as 8-bit per output channel (float8 on a GPU with
# FP8 matmuls, else integers: the same bytes, so placement counts it as "int8").
CHECKPOINT_METHODS = {"awq", "gptq", "fp8", "compressed-tensors"}
PACKED_4BIT = "qweight"  # AWQ's and GPTQ's int32 words of eight 4-bit codes
FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
# What such a checkpoint keeps beside a Linear's codes: its groups' zeros and scales, GPTQ's group of each
# input, FP8's scales and static activation scales; a layout's bytes a weight count them already.
SIDE_TENSORS = {
    "qzeros",
    "scales",
    "g_idx",
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "activation_scale",
}


class StoredTensor(NamedTuple):
    name: str
    elements: int
    dims: int
    gguf_type: str = ""  # the GGML type's name; "" in a safetensors checkpoint
    stored_as: Layout = (
        "dense"  # a quantized safetensors checkpoint's Linear weight: how quant = "auto" holds it
    )


def checkpoint_method(config: dict) -> str:
    """A safetensors checkpoint's quantization (config.json's `quantization_config.quant_method`:
    "awq", "gptq", "fp8", "compressed-tensors", or another transformers knows), "" where none."""
    return str((config.get("quantization_config") or {}).get("quant_method", "")).lower()


def checkpoint_tensor(name: str, shape: list[int], dtype: str, method: str) -> StoredTensor | None:
    """One tensor of a safetensors checkpoint as placement counts it. In a checkpoint quantized by
    one of CHECKPOINT_METHODS: packed 4-bit codes as the weight they unpack to (eight a word), an
    FP8 weight as a stored 8-bit one, a side tensor not at all (None); the rest as they are."""
    attr = name.rpartition(".")[2]
    elements = 1
    for dim in shape:
        elements *= dim
    if method not in CHECKPOINT_METHODS:
        return StoredTensor(name, elements, len(shape))
    if attr in SIDE_TENSORS:
        return None
    if attr == PACKED_4BIT:
        return StoredTensor(name, elements * 8, 2, stored_as="int4")
    if dtype == FP8_DTYPE and len(shape) == 2:
        return StoredTensor(name, elements, 2, stored_as="int8")
    return StoredTensor(name, elements, len(shape))


def gguf_layout(gguf_type: str) -> Layout:
    """How a GGUF Linear weight of this type runs under quant = "auto"."""
    if gguf_type in DENSE_TYPES:
        return "dense"
    if gguf_type in EXACT_INT8_TYPES:
        return "int8-groups"
    return "int8" if gguf_type in INT8_TYPES else "int4"


def _is_head_or_embedding(name: str) -> bool:
    return name == "output.weight" or any(
        part in name for part in ("embed", "lm_head", "token_embd", "wte")
    )


def layout(tensor: StoredTensor, quant: str) -> Layout:
    """How a node holds `tensor` under the catalogue's `quant`: Linear weights (2-D, neither the
    embedding nor the output head) quantized as the node quantizes them, the rest dense (tensor
    parallelism splits them as they are: each rank holds its share)."""
    if tensor.dims != 2:
        return "dense"
    if quant == "auto" and tensor.gguf_type:
        return "dense" if tensor.name == "token_embd.weight" else gguf_layout(tensor.gguf_type)
    if quant == "auto":
        return tensor.stored_as
    if quant in BYTES_PER_WEIGHT and not _is_head_or_embedding(tensor.name):
        return quant
    return "dense"


def split_over_ranks(tensor: StoredTensor, layers_only: bool) -> bool:
    """Whether tensor parallelism splits `tensor` over the ranks (each holds its part) rather than
    copying it whole to every rank. transformers' TP plan splits every 2-D weight: the layers'
    projections, and the embedding and output head on the vocabulary. The node's own loaders
    (`layers_only`: a GGUF file read as stored, a quantized checkpoint) split the layers'
    projections only (node_agent/model/linear_shards.py): the embedding and the head stay whole.
    Norms and biases count whole either way (a column-parallel layer's bias is split: a few bytes over)."""
    return tensor.dims == 2 and not (layers_only and _is_head_or_embedding(tensor.name))


def weight_bytes(tensors: list[StoredTensor], quant: str, dtype_bytes: int) -> int:
    """What the weights hold on a node's device(s)."""
    total = 0.0
    for tensor in tensors:
        held = layout(tensor, quant)
        total += tensor.elements * (dtype_bytes if held == "dense" else BYTES_PER_WEIGHT[held])
    return int(total)
