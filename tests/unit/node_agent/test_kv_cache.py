"""Which cache kind each layer gets from a model's config, how the paged cache maps positions to
blocks through the block tables, and what a sliding window lets each query see (unit tests of
node_agent/model/kv_cache.py, no model)."""

import pytest
import torch
from transformers import AutoConfig

from node_agent.model.kv_cache import (
    FULL,
    LINEAR,
    SLIDING,
    PagedAttention,
    PagedCache,
    bytes_per_token,
    layer_kinds,
)
from shared.model_files import ModelLoadError


@pytest.mark.parametrize(
    "model_type, overrides, kinds",
    [
        ("llama", {}, [FULL] * 4),
        ("mistral", {"sliding_window": 8}, [SLIDING] * 4),
        (
            "mistral",
            {"sliding_window": 4096},
            [FULL] * 4,
        ),  # a window over the whole context is full attention
        ("qwen2", {"sliding_window": 8}, [FULL] * 4),  # use_sliding_window is off
        ("gemma2", {"sliding_window": 8}, [SLIDING, FULL] * 2),
        ("qwen3_5_text", {}, [LINEAR] * 3 + [FULL]),
    ],
)
def test_layer_kinds_follow_the_config(model_type, overrides, kinds):
    assert (
        layer_kinds(AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides), max_len=256)
        == kinds
    )


def test_an_unknown_layer_kind_is_refused():
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        layer_kinds(config, max_len=256)


def _cache(blocks: int = 8, block_size: int = 4, window: int | None = None) -> PagedCache:
    layer = PagedAttention(
        blocks=blocks,
        block_size=block_size,
        kv_heads=1,
        head_dim=1,
        window=window,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return PagedCache(
        [layer],
        [FULL],
        slots=2,
        max_len=32,
        blocks=blocks,
        block_size=block_size,
        device=torch.device("cpu"),
    )


def test_rows_read_and_write_their_own_blocks_through_the_tables():
    cache = _cache()
    cache.set_tables(torch.tensor([[3, 1, 0, 0, 0, 0, 0, 0], [2, 5, 0, 0, 0, 0, 0, 0]]))
    positions = torch.arange(6)[None].repeat(2, 1)  # 6 tokens each: block 0 whole, 2 of block 1
    keys = (positions + torch.tensor([[100], [200]]))[
        :, None, :, None
    ].float()  # [B, heads, T, dim]
    cache.bind(slice(0, 2), positions, kv_len=6)
    read, _ = cache.update(keys, keys, 0)
    assert read.shape == (2, 1, 8, 1)  # whole blocks: 8 positions
    assert read[:, 0, :6, 0].tolist() == [[100 + p for p in range(6)], [200 + p for p in range(6)]]
    pool = cache.layers[0].keys[0, :, 0]  # [heads, slots, dim]
    assert pool[3 * 4 : 3 * 4 + 4].tolist() == [100, 101, 102, 103] and pool[
        1 * 4 : 1 * 4 + 2
    ].tolist() == [104, 105]
    assert pool[2 * 4 : 2 * 4 + 4].tolist() == [200, 201, 202, 203] and pool[
        5 * 4 : 5 * 4 + 2
    ].tolist() == [204, 205]


def test_padding_writes_only_the_null_block():
    cache = _cache()
    cache.set_tables(torch.tensor([[3, 1, 0, 0, 0, 0, 0, 0]]))
    positions = torch.tensor([[0, 1, cache.scratch_position]])
    keys = torch.tensor([7.0, 8.0, 9.0])[None, None, :, None]
    cache.bind(slice(0, 1), positions, kv_len=2)
    cache.update(keys, keys, 0)
    pool = cache.layers[0].keys[0, :, 0]  # [heads, slots, dim]
    assert pool[12:14].tolist() == [7, 8] and pool[0] == 9  # block 3; the padding in block 0
    assert pool[4:12].abs().sum() == 0 and pool[14:].abs().sum() == 0


def test_a_sliding_window_shows_each_query_its_window():
    window = 4
    mask = _cache(window=window).layers[0].attention_mask(torch.arange(9, 12)[None], width=16)[0, 0]
    for row, position in enumerate(range(9, 12)):
        assert mask[row].nonzero().flatten().tolist() == list(
            range(position - window + 1, position + 1)
        )


def test_an_image_sees_to_its_end():
    mask = (
        _cache()
        .layers[0]
        .attention_mask(torch.arange(4)[None], width=8, sees_until=torch.tensor([[0, 2, 2, 3]]))
    )
    assert mask[0, 0].int().tolist() == [  # positions 1 and 2 are one image
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ]


def test_linear_attention_layers_hold_no_keys():
    def per_token(model_type, **overrides):
        config = AutoConfig.for_model(
            model_type,
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            **overrides,
        )
        return bytes_per_token(config, max_len=1024, dtype_bytes=4)

    assert per_token("llama") == 2 * 4 * 2 * 16 * 4
    assert (
        per_token(
            "qwen3_5_text",
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
        == per_token("llama") // 4
    )  # 3 of its 4 layers are linear
