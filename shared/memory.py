"""How much device memory one replica of a model needs: its weights (as the dtype it will run in)
plus its paged KV cache, plus a margin for activations. Read from the files' headers only, so the
gateway can place a model no node has loaded yet.

The KV cache follows the node's rule (node_agent/model/model_calls.py `kv_blocks`): the profile's
`kv_cache_mb`, else enough blocks for `slots` sequences of `max_model_len` tokens. Only attention
layers hold keys and values (a linear-attention layer's state is small). A `kv_memory_fraction`
takes what the device has free at load: placement counts the slots' worth for it."""

import json
from functools import lru_cache
from pathlib import Path

from shared.catalog import ModelProfile
from shared.model_files import locate

_MB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN = 1.10  # activations, workspace


def kv_cache_bytes(profile: ModelProfile, *, layers: int, kv_heads: int, head_dim: int, max_len: int,
                   dtype_bytes: int) -> int:
    """The paged cache's bytes: `kv_cache_mb`, else blocks for `slots` sequences of `max_len` tokens."""
    if profile.kv_cache_mb is not None:
        return profile.kv_cache_mb * _MB
    tokens = profile.slots * -(-max_len // profile.block_size) * profile.block_size
    return 2 * layers * kv_heads * head_dim * tokens * dtype_bytes


def _gguf_facts(path: Path) -> tuple[int, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(path)  # parses the whole header: seconds for a large vocabulary

    def field(name: str, default: int = 0) -> int:
        found = reader.fields.get(f"{arch}.{name}")
        return int(found.parts[-1][0]) if found else default
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = field("attention.head_count")
    shape = dict(layers=field("block_count"), kv_heads=field("attention.head_count_kv", heads),
                 head_dim=field("attention.key_length") or field("embedding_length") // heads,
                 context=field("context_length"))
    return sum(int(t.n_elements) for t in reader.tensors), shape


def _safetensors_facts(folder: Path) -> tuple[int, dict]:
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                total += count
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    shape = dict(layers=sum(kind != "linear_attention" for kind in kinds),
                 kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                 context=config.get("max_position_embeddings") or 0)
    return total, shape


@lru_cache(maxsize=64)
def _estimate(profile_json: str) -> int:
    profile = ModelProfile.model_validate_json(profile_json)
    files = locate(profile)
    dtype_bytes = _DTYPE_BYTES.get(profile.dtype, 4)  # "auto" may pick bf16; fp32 is the safe guess
    params, shape = _gguf_facts(files.folder / files.gguf_file) if files.gguf_file else _safetensors_facts(files.folder)
    weights = params * (1 if profile.quant == "int8" else dtype_bytes)
    max_len, _ = profile.effective_context(shape.pop("context") or None)
    cache = kv_cache_bytes(profile, max_len=max_len, dtype_bytes=dtype_bytes, **shape)
    return int((weights + cache) * MARGIN / _MB) + 1


def estimate_mb(profile: ModelProfile) -> int:
    """`memory_mb` from the catalogue, else an estimate from the files on this host."""
    if profile.memory_mb is not None:
        return profile.memory_mb
    return _estimate(profile.model_dump_json())
