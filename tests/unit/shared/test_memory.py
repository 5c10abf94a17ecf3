"""The placement estimate (shared/memory.py) sizes the paged KV cache by the node's rule: the
profile's kv_cache_mb, else slots x max_model_len tokens, over the attention layers only."""

import pytest

from shared import memory
from tests.model_fixtures import tiny_profile


def test_the_kv_cache_is_the_budget_or_every_slots_whole_context():
    profile = tiny_profile(memory.Path("/nowhere"), slots=64, max_model_len=500, block_size=16)
    shape = dict(layers=2, kv_heads=2, head_dim=16, max_len=500, dtype_bytes=4)  # 512 bytes a token
    assert memory.kv_cache_bytes(profile, **shape) == 64 * 512 * 512  # 500 tokens take 32 blocks of 16
    assert memory.kv_cache_bytes(profile.model_copy(update={"kv_cache_mb": 3}), **shape) == 3 << 20


def test_only_attention_layers_count(small_vocab_dirs):
    assert memory._safetensors_facts(small_vocab_dirs["llama"])[1]["layers"] == 2
    assert memory._safetensors_facts(small_vocab_dirs["qwen3_5_text"])[1]["layers"] == 1  # 3 of 4 are linear
    llama = tiny_profile(small_vocab_dirs["llama"], slots=64, max_model_len=512)
    saved = memory.estimate_mb(llama) - memory.estimate_mb(llama.model_copy(update={"kv_cache_mb": 1}))
    assert saved == pytest.approx((64 * 512 * 512 - (1 << 20)) * memory.MARGIN / (1 << 20), abs=1)
