"""The placement estimate (shared/memory.py) sizes the paged KV cache by the node's rule: the
profile's kv_cache_mb, else DEFAULT_KV_CACHE_MB capped at slots x max_model_len tokens and never
below one sequence, over the attention layers only; and counts each slot's own state."""

import json

import pytest
from transformers import AutoModel

from shared import memory
from shared.catalog import Catalog, ModelProfile
from tests import tiny_poolers
from tests.model_fixtures import tiny_profile

SMOLLM2_FP32 = dict(layers=30, kv_heads=3, head_dim=64, dtype_bytes=4)  # 46,080 bytes a token
SMOLLM2_BLOCK = 46_080 * 16


def test_the_kv_cache_is_the_budget_or_every_slots_whole_context():
    profile = tiny_profile(memory.Path("/nowhere"), slots=64, max_model_len=500, block_size=16)
    shape = dict(layers=2, kv_heads=2, head_dim=16, max_len=500, dtype_bytes=4)  # 512 bytes a token
    assert memory.kv_cache_bytes(profile, **shape) == 64 * 512 * 512  # 500 tokens take 32 blocks of 16
    assert memory.kv_cache_bytes(profile.model_copy(update={"kv_cache_mb": 3}), **shape) == 3 << 20


def test_the_default_kv_cache_is_a_memory_budget_not_slots_times_the_context():
    default = ModelProfile(id="m", source="x")
    assert (default.slots, default.max_model_len, memory.DEFAULT_KV_CACHE_MB) == (128, 4096, 2048)
    blocks = (2048 << 20) // SMOLLM2_BLOCK  # 2,912 blocks: 46,592 tokens, not 128 x 4,096 (24 GB)
    assert memory.kv_cache_bytes(default, max_len=4096, **SMOLLM2_FP32) == blocks * SMOLLM2_BLOCK == 2_146_959_360
    # a kv_memory_fraction takes what the device has free at load: placement counts the default
    fraction = default.model_copy(update={"kv_memory_fraction": 0.5})
    assert memory.kv_cache_bytes(fraction, max_len=4096, **SMOLLM2_FP32) == blocks * SMOLLM2_BLOCK


def test_the_default_kv_cache_holds_at_most_every_slots_context_and_at_least_one():
    few = ModelProfile(id="m", source="x", slots=4)
    assert memory.kv_cache_bytes(few, max_len=4096, **SMOLLM2_FP32) == 4 * 256 * SMOLLM2_BLOCK  # 720 MiB
    assert memory.kv_cache_bytes(few, max_len=4000, **SMOLLM2_FP32) == 4 * 250 * SMOLLM2_BLOCK
    long = ModelProfile(id="m", source="x", max_model_len=65536)  # one sequence: 2,880 MiB, over the budget
    assert memory.kv_cache_bytes(long, max_len=65536, **SMOLLM2_FP32) == 4096 * SMOLLM2_BLOCK
    assert memory.default_kv_blocks(long, block_bytes=SMOLLM2_BLOCK, max_len=65536) == 4096
    assert memory.default_kv_blocks(few, block_bytes=1, max_len=100) == 4 * 7  # ceil(100 / 16) blocks a slot


def test_a_slot_holds_sampling_state_over_the_vocabulary_and_its_linear_attention_states():
    assert memory.row_bytes(vocab=49152, dtype_bytes=4) == 9 * 49152  # 442 KiB; 54 MiB for 128 slots
    linear = dict(linear_layers=3, conv=100, recurrent=1000)
    assert memory.row_bytes(vocab=10, dtype_bytes=2, **linear) == 90 + 3 * (100 * 2 + 1000 * 4)


def test_a_config_without_layer_types_has_every_full_attention_intervalth_layer_full(tmp_path):
    linear = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_conv_kernel_dim=4)  # Qwen3-Next-80B-A3B's
    config = dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256, hidden_size=2048, vocab_size=151936,
                  num_hidden_layers=48, full_attention_interval=4, **linear)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, shape, rows = memory._safetensors_facts(tmp_path)
    assert shape["layers"] == 12 and rows["linear_layers"] == 36
    per_slot = memory.row_bytes(dtype_bytes=2, **rows)  # 74 MiB of linear-attention state: 9.3 GiB for 128 slots
    assert per_slot == 9 * 151936 + 36 * ((2 * 128 * 16 + 128 * 32) * 4 * 2 + 32 * 128 * 128 * 4)
    del config["full_attention_interval"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert memory._safetensors_facts(tmp_path)[1]["layers"] == 48


def test_the_default_model_is_estimated_at_its_weights_a_2_gb_cache_and_128_slots():
    profile = Catalog.load(None).resolve("default").model_copy(update={"dtype": "float32", "quant": "none"})
    weights, cache, slots = 134_515_008 * 4, 2_146_959_360, 128 * 9 * 49152
    assert memory.estimate_mb(profile) == int((weights + cache + slots) * memory.MARGIN / (1 << 20)) + 1 == 2877
    # as its file stores it: 4-bit layers (0.625 bytes a weight) and the float32 embedding (113 MB)
    four_bit = 134_515_008 - 28_311_552 - 61 * 576
    weights = 28_311_552 * 4 + int(four_bit * 0.625) + 61 * 576 * 4
    assert memory.estimate_mb(profile.model_copy(update={"quant": "auto"})) == int(
        (weights + cache + slots) * memory.MARGIN / (1 << 20)) + 1 == 2501


def test_only_attention_layers_count(small_vocab_dirs):
    assert memory._safetensors_facts(small_vocab_dirs["llama"])[1]["layers"] == 2
    assert memory._safetensors_facts(small_vocab_dirs["qwen3_5_text"])[1]["layers"] == 1  # 3 of 4 are linear
    llama = tiny_profile(small_vocab_dirs["llama"], slots=64, max_model_len=512)
    saved = memory.estimate_mb(llama) - memory.estimate_mb(llama.model_copy(update={"kv_cache_mb": 1}))
    assert saved == pytest.approx((64 * 512 * 512 - (1 << 20)) * memory.MARGIN / (1 << 20), abs=1)


def test_an_embedding_model_counts_its_weights_and_one_pass(tmp_path):
    folder = tiny_poolers.build_embedder(tmp_path / "embed")
    profile = ModelProfile(id="e", kind="embedding", source=str(folder), dtype="float32", max_model_len=128)
    weights = 4 * sum(p.numel() for p in AutoModel.from_pretrained(folder).parameters())
    pass_bytes = memory.pooling_pass_bytes(profile, hidden=64, intermediate=128, heads=4, max_len=128)
    assert pass_bytes == 8192 * (128 + 4 * 64 + 4 * 128) * 4  # no KV cache, no slots' sampling state
    assert memory.estimate_mb(profile) == int((weights + pass_bytes) * memory.MARGIN / (1 << 20)) + 1
