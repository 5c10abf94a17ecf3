"""GGUF files written at test time from tiny transformers models (tests/tiny_models.py), as
llama.cpp's converter lays them out: its tensor names, llama's Q/K rows permuted, norms and the
embedding in F32, every Linear weight in one quantized type. gguf-py quantizes Q4_0, Q4_1 and Q8_0
itself; it cannot write k-quants, so Q4_K/Q5_K/Q6_K tensors get valid blocks of random codes and
scales (the model then is whatever those blocks say; tests compare it with its own dequantised copy)."""

import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file
from transformers import AutoConfig

from tests import tiny_models

WRITABLE = {T.Q4_0, T.Q4_1, T.Q8_0}
# Where a k-quant block keeps its float16 super-block scales (d, dmin): the other bytes are codes
# and 6- or 8-bit sub-scales, valid whatever they hold.
_SUPER_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (-2,)}
_ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a llama Q/K weight's rows (transformers undoes it at load)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _random_k_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_elements, block_bytes), dtype=np.uint8)
    for at, scale in zip(_SUPER_SCALES[qtype], (0.002, 0.006)):
        blocks[:, at : at + 2 or None] = np.array([scale], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def tiny_llama(folder: Path, linear_type: T) -> Path:
    """A tiny Llama (hidden 64) as `folder/llama.gguf`, its Linear weights as `linear_type`."""
    hf_folder = tiny_models.build(
        "llama",
        folder / "llama",
        tiny_models.make_tokenizer(),
        hidden_size=64,
        intermediate_size=128,
    )
    return write(hf_folder, folder / "llama.gguf", linear_type)


def write(
    hf_folder: Path, path: Path, linear_type: T, seed: int = 0, embedding_type: T = T.F32
) -> Path:
    """Write the model in `hf_folder` (llama or qwen3) to `path`, its Linear weights as `linear_type`
    and its token embedding as `embedding_type` (F32, or Q8_0 as llama.cpp's converter keeps it
    beside 4-bit layers)."""
    config = AutoConfig.from_pretrained(hf_folder)
    arch = _ARCHES[config.model_type]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(hf_folder.name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    for hf_name, weight in load_file(hf_folder / "model.safetensors").items():
        name = names.get_name(hf_name.removesuffix(".weight")) + ".weight"
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
            weight = _permute(weight, heads)
        if name == "token_embd.weight" and embedding_type != T.F32:
            writer.add_tensor(
                name,
                gguf.quants.quantize(weight.astype(np.float32), embedding_type),
                raw_dtype=embedding_type,
            )
        elif weight.ndim != 2 or name == "token_embd.weight":
            writer.add_tensor(name, weight.astype(np.float32))
        elif linear_type in WRITABLE:
            writer.add_tensor(
                name,
                gguf.quants.quantize(weight.astype(np.float32), linear_type),
                raw_dtype=linear_type,
            )
        else:
            writer.add_tensor(
                name, _random_k_blocks(*weight.shape, linear_type, rng), raw_dtype=linear_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Files made byte by byte, for the header reader's bounds (tests/unit/shared/test_gguf_hostile.py)
STRING, ARRAY = 8, 9  # GGUF value types


def gguf_string(text: str, length: int | None = None) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data) if length is None else length) + data


def gguf_kv_string(key: str, value: str) -> bytes:
    return gguf_string(key) + struct.pack("<I", STRING) + gguf_string(value)


def gguf_tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return (
        gguf_string(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", qtype, offset)
    )


def gguf_bytes(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", counts=None) -> bytes:
    """A GGUF v3 file: magic, version, counts (the true ones unless given), fields, tensor
    infos, padding to 32 bytes, the data."""
    tensor_count, kv_count = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + b"".join(kvs + tensors)
    return head + b"\0" * (-len(head) % 32) + data


# The `gguf` reader's endless loop: past the end each item reads as nothing, and it goes on.
ENDLESS = gguf_bytes(
    [
        gguf_kv_string("general.architecture", "llama"),
        gguf_string("general.x") + struct.pack("<IIQ", ARRAY, 0, 1 << 40),
    ],
    [],
)
