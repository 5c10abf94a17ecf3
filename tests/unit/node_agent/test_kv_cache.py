"""Which cache kind each layer gets from a model's config, and what the sliding-window ring lets
each query see (unit tests of node_agent/model/kv_cache.py, no model)."""

import pytest
import torch
from transformers import AutoConfig

from node_agent.model.kv_cache import FULL, LINEAR, SLIDING, AttentionKV, SlotCache, layer_kinds
from shared.model_files import ModelLoadError


@pytest.mark.parametrize("model_type, overrides, kinds", [
    ("llama", {}, [FULL] * 4),
    ("mistral", {"sliding_window": 8}, [SLIDING] * 4),
    ("mistral", {"sliding_window": 4096}, [FULL] * 4),  # a window over the whole context is full attention
    ("qwen2", {"sliding_window": 8}, [FULL] * 4),  # use_sliding_window is off
    ("gemma2", {"sliding_window": 8}, [SLIDING, FULL] * 2),
    ("qwen3_5_text", {}, [LINEAR] * 3 + [FULL]),
])
def test_layer_kinds_follow_the_config(model_type, overrides, kinds):
    assert layer_kinds(AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides), max_len=256) == kinds


def test_an_unknown_layer_kind_is_refused():
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        layer_kinds(config, max_len=256)


def test_a_sliding_window_ring_shows_each_query_its_window():
    window, columns, max_len = 4, 7, 64
    layer = AttentionKV(slots=1, kv_heads=1, head_dim=1, columns=columns, window=window, scratch_position=max_len,
                        dtype=torch.float32, device=torch.device("cpu"))
    for position in range(9):  # what earlier chunks wrote: position p at column p mod 7, its key p
        layer.keys[0, 0, position % columns] = position
    positions = torch.arange(9, 12)[None]  # then a chunk of 3 tokens at positions 9..11
    keys = positions[:, None, :, None].float()
    layer.update(keys, keys, slice(0, 1), positions, 12)
    mask = layer.attention_mask(positions, kv_len=12)[0, 0]
    for row, position in enumerate(positions[0].tolist()):
        seen = sorted(int(layer.keys[0, 0, c]) for c in range(columns) if mask[row, c])
        assert seen == list(range(position - window + 1, position + 1))


def test_the_cache_is_smaller_with_windows_and_linear_state():
    def cache_bytes(model_type, **overrides):
        config = AutoConfig.for_model(model_type, num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, **overrides)
        return SlotCache.for_model(config, slots=2, max_len=1024, prefill_chunk_tokens=16, dtype=torch.float32,
                                   device=torch.device("cpu")).bytes
    full = cache_bytes("llama")
    assert cache_bytes("mistral", sliding_window=8) < full / 10
    assert cache_bytes("qwen3_5_text", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16) < full / 2
