"""How much device memory one replica of a model needs: its weights (quantized as the node will hold
them, shared/weight_formats.py, else in the dtype it will run in),
its paged KV cache and its slots' own state (`row_bytes`), plus a margin for activations. Read
from the files' headers only, so the gateway can place a model no node has loaded yet.

The KV cache follows the node's rule (node_agent/model/model_calls.py `kv_blocks`, sized with
`default_kv_blocks` here): the profile's `kv_cache_mb`, else `DEFAULT_KV_CACHE_MB`, capped at
`slots` sequences of `max_model_len` tokens and never below one. Only attention layers hold keys
and values (a linear-attention layer keeps a state per slot instead). A `kv_memory_fraction`
takes what the device has free at load: placement counts the default's worth for it. An embedding or
rerank model holds no KV cache: its weights and one forward pass (`pooling_pass_bytes`).

A model sharded over N devices (`tensor_parallel`) is estimated per device, as its rank 0 holds
it: each tensor the ranks copy whole, a 1/N part of each they split (`weights_per_device`), 1/N of
the KV cache (each rank holds its share of the key/value heads in every block) and every slot's
state whole (rank 0 alone samples)."""

import json
from functools import lru_cache
from pathlib import Path

from shared import gguf_header
from shared.catalog import ModelProfile
from shared.model_files import ModelFiles, locate
from shared.weight_formats import (
    StoredTensor,
    checkpoint_method,
    checkpoint_tensor,
    layout,
    split_over_ranks,
    weight_bytes,
)

_MB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN = 1.10  # activations, workspace
# The paged KV cache of a model whose profile sets neither `kv_cache_mb` nor `kv_memory_fraction`
# (the node's cache and the placement estimate both): SmolLM2-135M's 45 KiB a token in fp32 make
# it 46,592 tokens, 11 sequences of 4,096 (twice as many in bf16).
DEFAULT_KV_CACHE_MB = 2048


def default_kv_blocks(profile: ModelProfile, *, block_bytes: int, max_len: int) -> int:
    """The blocks of the default cache: `DEFAULT_KV_CACHE_MB` of blocks of `block_bytes`, at most
    `slots` sequences of `max_len` tokens (no row could use more), at least one (so that a prompt
    the context admits always fits)."""
    sequence = -(-max_len // profile.block_size)
    return min(max(DEFAULT_KV_CACHE_MB * _MB // block_bytes, sequence), profile.slots * sequence)


def kv_cache_bytes(
    profile: ModelProfile,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype_bytes: int,
) -> int:
    """The paged cache's bytes: `kv_cache_mb`, else the default's blocks (`default_kv_blocks`)."""
    if profile.kv_cache_mb is not None:
        return profile.kv_cache_mb * _MB
    block_bytes = 2 * layers * kv_heads * head_dim * dtype_bytes * profile.block_size
    return (
        default_kv_blocks(profile, block_bytes=block_bytes, max_len=max_len) * block_bytes
        if block_bytes
        else 0
    )


def row_bytes(
    *, vocab: int, dtype_bytes: int, linear_layers: int = 0, conv: int = 0, recurrent: int = 0
) -> int:
    """What one slot holds whether a sequence runs there or not: its sampling state over the
    vocabulary (node_agent/model/sampling.py: output counts and logit bias in float32, the prompt's
    tokens as bools) and each linear-attention layer's last conv inputs (`conv` elements, the
    model's dtype) and recurrent state (`recurrent` elements, float32)."""
    return (4 + 4 + 1) * vocab + linear_layers * (conv * dtype_bytes + recurrent * 4)


def weights_per_device(
    tensors: list[StoredTensor], quant: str, dtype_bytes: int, ranks: int, layers_only: bool
) -> int:
    """What the weights hold on each of `ranks` devices: every tensor the ranks copy whole, and a
    `ranks`-th of each they split (shared/weight_formats.py `split_over_ranks`)."""
    split, whole = [], []
    for tensor in tensors:
        (split if split_over_ranks(tensor, layers_only) else whole).append(tensor)
    return (
        weight_bytes(whole, quant, dtype_bytes) + weight_bytes(split, quant, dtype_bytes) // ranks
    )


def device_weight_bytes(
    profile: ModelProfile, tensors: list[StoredTensor], dtype_bytes: int, gguf: bool
) -> int:
    """What a generate model's weights hold on each of its `tensor_parallel` devices, as whoever
    loads it splits them (`read_by_node_loaders`)."""
    return weights_per_device(
        tensors,
        profile.quant,
        dtype_bytes,
        profile.tensor_parallel,
        read_by_node_loaders(tensors, profile.quant, gguf),
    )


def read_by_node_loaders(tensors: list[StoredTensor], quant: str, gguf: bool) -> bool:
    """Whether the node's own loaders read the model, splitting its layers' projections only: a
    GGUF file whose Linear weights quant "auto" keeps as stored, or a quantized checkpoint (any
    quant). Else transformers loads it and its TP plan splits the embedding and head too."""
    return (quant == "auto" or not gguf) and any(layout(t, "auto") != "dense" for t in tensors)


def stored_facts(files: ModelFiles) -> tuple[list[StoredTensor], dict, dict]:
    """A model's stored tensors, its attention shape and what each slot holds, from its GGUF file or
    its safetensors files' headers."""
    return (
        _gguf_facts(files.folder / files.gguf_file)
        if files.gguf_file
        else _safetensors_facts(files.folder)
    )


def _gguf_facts(path: Path) -> tuple[list[StoredTensor], dict, dict]:
    header = gguf_header.read(path)  # parsed once for placement and the loader
    heads = header.number("attention.head_count")
    shape = dict(
        layers=header.number("block_count"),
        kv_heads=header.number("attention.head_count_kv", heads),
        head_dim=header.number("attention.key_length")
        or header.number("embedding_length") // heads,
        context=header.number("context_length"),
    )
    rows = dict(vocab=header.vocab_size)
    tensors = [StoredTensor(t.name, t.elements, len(t.shape), t.gguf_type) for t in header.tensors]
    return tensors, shape, rows


def _safetensors_facts(folder: Path) -> tuple[list[StoredTensor], dict, dict]:
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    tensors = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                stored = f.get_slice(name)
                if tensor := checkpoint_tensor(
                    name, stored.get_shape(), stored.get_dtype(), checkpoint_method(config)
                ):
                    tensors.append(tensor)
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    kinds = config.get("layer_types") or _layer_kinds(config)
    shape = dict(
        layers=sum(kind != "linear_attention" for kind in kinds),
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        context=config.get("max_position_embeddings") or 0,
    )
    rows = dict(vocab=config.get("vocab_size") or 0)
    if (
        "linear_attention" in kinds
    ):  # GatedDeltaNet (node_agent/model/kv_cache.py LinearAttentionState)
        k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
        k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
        rows |= dict(
            linear_layers=kinds.count("linear_attention"),
            conv=(2 * k_dim * k_heads + v_dim * v_heads) * config["linear_conv_kernel_dim"],
            recurrent=v_heads * k_dim * v_dim,
        )
    return tensors, shape, rows


def _layer_kinds(config: dict) -> list[str]:
    """A config without `layer_types`: every `full_attention_interval`-th layer full attention, the
    rest linear (as transformers reads Qwen3-Next's and Qwen3.5's), else all full attention."""
    interval = config.get("full_attention_interval")
    return [
        "linear_attention" if interval and (i + 1) % interval else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]


def pooling_pass_bytes(
    profile: ModelProfile, *, hidden: int, intermediate: int, heads: int, max_len: int
) -> int:
    """What one forward pass of an embedding or rerank model holds besides its weights (it keeps no
    KV cache): for each of `pooling_batch_tokens` tokens, float32 hidden states, MLP activations
    and attention scores over a row of up to `max_len` tokens."""
    return profile.pooling_batch_tokens * (intermediate + 4 * hidden + heads * max_len) * 4


@lru_cache(maxsize=64)
def _estimate(profile_json: str) -> int:
    profile = ModelProfile.model_validate_json(profile_json)
    files = locate(profile)
    dtype_bytes = _DTYPE_BYTES.get(profile.dtype, 4)  # "auto" may pick bf16; fp32 is the safe guess
    tensors, shape, rows = stored_facts(files)
    if profile.kind != "generate":
        config = json.loads((files.folder / "config.json").read_text())
        hidden = config["hidden_size"]
        activations = pooling_pass_bytes(
            profile,
            hidden=hidden,
            intermediate=config.get("intermediate_size", 4 * hidden),
            heads=config["num_attention_heads"],
            max_len=profile.effective_context(shape["context"] or None)[0],
        )
        return int((weight_bytes(tensors, "none", dtype_bytes) + activations) * MARGIN / _MB) + 1
    weights = device_weight_bytes(profile, tensors, dtype_bytes, bool(files.gguf_file))
    max_len, _ = profile.effective_context(shape.pop("context") or None)
    cache = (
        kv_cache_bytes(profile, max_len=max_len, dtype_bytes=dtype_bytes, **shape)
        // profile.tensor_parallel
    )
    slots = profile.slots * row_bytes(dtype_bytes=dtype_bytes, **rows)
    return int((weights + cache + slots) * MARGIN / _MB) + 1


def estimate_mb(profile: ModelProfile) -> int:
    """What each of the model's devices needs: `memory_mb` from the catalogue (one replica's, over
    its `tensor_parallel` devices), else an estimate from the files on this host."""
    if profile.memory_mb is not None:
        return -(-profile.memory_mb // profile.tensor_parallel)
    return _estimate(profile.model_dump_json())
