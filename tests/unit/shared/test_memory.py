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
    assert (
        memory.kv_cache_bytes(profile, **shape) == 64 * 512 * 512
    )  # 500 tokens take 32 blocks of 16
    assert memory.kv_cache_bytes(profile.model_copy(update={"kv_cache_mb": 3}), **shape) == 3 << 20


def test_the_default_kv_cache_is_a_memory_budget_not_slots_times_the_context():
    default = ModelProfile(id="m", source="x")
    assert (default.slots, default.max_model_len, memory.DEFAULT_KV_CACHE_MB) == (128, 4096, 2048)
    blocks = (2048 << 20) // SMOLLM2_BLOCK  # 2,912 blocks: 46,592 tokens, not 128 x 4,096 (24 GB)
    assert (
        memory.kv_cache_bytes(default, max_len=4096, **SMOLLM2_FP32)
        == blocks * SMOLLM2_BLOCK
        == 2_146_959_360
    )
    # a kv_memory_fraction takes what the device has free at load: placement counts the default
    fraction = default.model_copy(update={"kv_memory_fraction": 0.5})
    assert memory.kv_cache_bytes(fraction, max_len=4096, **SMOLLM2_FP32) == blocks * SMOLLM2_BLOCK


def test_the_default_kv_cache_holds_at_most_every_slots_context_and_at_least_one():
    few = ModelProfile(id="m", source="x", slots=4)
    assert (
        memory.kv_cache_bytes(few, max_len=4096, **SMOLLM2_FP32) == 4 * 256 * SMOLLM2_BLOCK
    )  # 720 MiB
    assert memory.kv_cache_bytes(few, max_len=4000, **SMOLLM2_FP32) == 4 * 250 * SMOLLM2_BLOCK
    long = ModelProfile(
        id="m", source="x", max_model_len=65536
    )  # one sequence: 2,880 MiB, over the budget
    assert memory.kv_cache_bytes(long, max_len=65536, **SMOLLM2_FP32) == 4096 * SMOLLM2_BLOCK
    assert memory.default_kv_blocks(long, block_bytes=SMOLLM2_BLOCK, max_len=65536) == 4096
    assert (
        memory.default_kv_blocks(few, block_bytes=1, max_len=100) == 4 * 7
    )  # ceil(100 / 16) blocks a slot


def test_a_slot_holds_sampling_state_over_the_vocabulary_and_its_linear_attention_states():
    assert (
        memory.row_bytes(vocab=49152, dtype_bytes=4) == 9 * 49152
    )  # 442 KiB; 54 MiB for 128 slots
    linear = dict(linear_layers=3, conv=100, recurrent=1000)
    assert memory.row_bytes(vocab=10, dtype_bytes=2, **linear) == 90 + 3 * (100 * 2 + 1000 * 4)


def test_a_config_without_layer_types_has_every_full_attention_intervalth_layer_full(tmp_path):
    linear = dict(
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_conv_kernel_dim=4,
    )  # Qwen3-Next-80B-A3B's
    config = dict(
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        hidden_size=2048,
        vocab_size=151936,
        num_hidden_layers=48,
        full_attention_interval=4,
        **linear,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, shape, rows = memory._safetensors_facts(tmp_path)
    assert shape["layers"] == 12 and rows["linear_layers"] == 36
    per_slot = memory.row_bytes(
        dtype_bytes=2, **rows
    )  # 74 MiB of linear-attention state: 9.3 GiB for 128 slots
    assert per_slot == 9 * 151936 + 36 * ((2 * 128 * 16 + 128 * 32) * 4 * 2 + 32 * 128 * 128 * 4)
    del config["full_attention_interval"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert memory._safetensors_facts(tmp_path)[1]["layers"] == 48


def test_the_default_model_is_estimated_at_its_weights_a_2_gb_cache_and_128_slots():
    profile = (
        Catalog.load(None)
        .resolve("default")
        .model_copy(update={"dtype": "float32", "quant": "none"})
    )
    weights, cache, slots = 134_515_008 * 4, 2_146_959_360, 128 * 9 * 49152
    assert (
        memory.estimate_mb(profile)
        == int((weights + cache + slots) * memory.MARGIN / (1 << 20)) + 1
        == 2877
    )
    # as its file stores it: 4-bit layers (0.625 bytes a weight) and the float32 embedding (113 MB)
    four_bit = 134_515_008 - 28_311_552 - 61 * 576
    weights = 28_311_552 * 4 + int(four_bit * 0.625) + 61 * 576 * 4
    assert (
        memory.estimate_mb(profile.model_copy(update={"quant": "auto"}))
        == int((weights + cache + slots) * memory.MARGIN / (1 << 20)) + 1
        == 2501
    )
    # quantized at load to 8 bits, integer or float8 alike: a byte a weight of the layers (embedding and head dense)
    weights = 28_311_552 * 4 + four_bit + 61 * 576 * 4
    for bits in ("int8", "fp8"):
        assert (
            memory.estimate_mb(profile.model_copy(update={"quant": bits}))
            == int((weights + cache + slots) * memory.MARGIN / (1 << 20)) + 1
        ), bits


def test_only_attention_layers_count(small_vocab_dirs):
    assert memory._safetensors_facts(small_vocab_dirs["llama"])[1]["layers"] == 2
    assert (
        memory._safetensors_facts(small_vocab_dirs["qwen3_5_text"])[1]["layers"] == 1
    )  # 3 of 4 are linear
    llama = tiny_profile(small_vocab_dirs["llama"], slots=64, max_model_len=512)
    saved = memory.estimate_mb(llama) - memory.estimate_mb(
        llama.model_copy(update={"kv_cache_mb": 1})
    )
    assert saved == pytest.approx((64 * 512 * 512 - (1 << 20)) * memory.MARGIN / (1 << 20), abs=1)


def test_an_embedding_model_counts_its_weights_and_one_pass(tmp_path):
    folder = tiny_poolers.build_embedder(tmp_path / "embed")
    profile = ModelProfile(
        id="e", kind="embedding", source=str(folder), dtype="float32", max_model_len=128
    )
    weights = 4 * sum(p.numel() for p in AutoModel.from_pretrained(folder).parameters())
    pass_bytes = memory.pooling_pass_bytes(
        profile, hidden=64, intermediate=128, heads=4, max_len=128
    )
    assert (
        pass_bytes == 8192 * (128 + 4 * 64 + 4 * 128) * 4
    )  # no KV cache, no slots' sampling state
    assert (
        memory.estimate_mb(profile) == int((weights + pass_bytes) * memory.MARGIN / (1 << 20)) + 1
    )


def awq_llama(folder: memory.Path, *, vocab: int, hidden: int, layers: int) -> memory.Path:
    """The files of an AWQ Llama (4-bit codes in groups of 128), every tensor zeros: what the
    estimate reads of them is their names, shapes and dtypes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden // 2, hidden),
        "v_proj": (hidden // 2, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (2 * hidden, hidden),
        "up_proj": (2 * hidden, hidden),
        "down_proj": (hidden, 2 * hidden),
    }
    tensors = {
        "model.embed_tokens.weight": torch.zeros(vocab, hidden),
        "model.norm.weight": torch.zeros(hidden),
    }
    for i in range(layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.zeros(hidden)
        for proj, (out, inputs) in shapes.items():
            owner = f"model.layers.{i}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
            tensors |= {
                f"{owner}.qweight": torch.zeros(inputs, out // 8, dtype=torch.int32),
                f"{owner}.qzeros": torch.zeros(inputs // 128, out // 8, dtype=torch.int32),
                f"{owner}.scales": torch.zeros(inputs // 128, out, dtype=torch.float16),
            }
    save_file(tensors, folder / "model.safetensors")
    config = dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        quantization_config=dict(
            quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"
        ),
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_sharded_quantized_model_holds_its_embedding_whole_on_every_device(tmp_path):
    """The node's loaders split an AWQ model's projections over the ranks and copy its embedding
    (tied to the head) and norms to each: each device needs the embedding whole, more than half of
    the model, with half of the projections and of the KV cache and every slot's sampling state."""
    vocab, hidden, layers = 65536, 256, 2
    folder = awq_llama(tmp_path / "awq", vocab=vocab, hidden=hidden, layers=layers)
    profile = tiny_profile(folder, slots=2, max_model_len=256, quant="auto")
    embedding, norms = vocab * hidden * 4, (layers + 1) * hidden * 4  # 64 MiB of 65 MiB
    projections = int(
        layers * 9 * hidden * hidden * 0.625
    )  # q, o; k, v at half; gate, up, down at twice
    cache = (
        2 * 256 * 2 * layers * 2 * 64 * 4
    )  # 2 slots of 256 tokens: keys and values of 2 heads of 64
    slots = 2 * memory.row_bytes(vocab=vocab, dtype_bytes=4)
    assert (
        memory.weight_bytes(memory._safetensors_facts(folder)[0], "auto", 4)
        == embedding + norms + projections
    )
    assert (
        memory.kv_cache_bytes(
            profile, layers=layers, kv_heads=2, head_dim=64, max_len=256, dtype_bytes=4
        )
        == cache
    )
    whole = memory.estimate_mb(profile)
    per_device = memory.estimate_mb(profile.model_copy(update={"tensor_parallel": 2}))
    device_bytes = embedding + norms + projections // 2 + cache // 2 + slots
    assert per_device == int(device_bytes * memory.MARGIN / (1 << 20)) + 1
    assert (
        per_device * (1 << 20) >= embedding * memory.MARGIN > whole * (1 << 20) / 2
    )  # (half of it would not hold it)


def test_a_catalogue_memory_mb_is_one_replicas_shared_over_its_devices():
    profile = ModelProfile(id="m", source="x", memory_mb=1001)
    assert memory.estimate_mb(profile) == 1001
    assert memory.estimate_mb(profile.model_copy(update={"tensor_parallel": 2})) == 501


def test_transformers_splits_a_full_precision_models_embedding_the_node_loaders_copy_it():
    """transformers' TP plan splits the embedding and head on the vocabulary ("embedding_rowwise",
    "colwise_gather_output"); the node's loaders (a GGUF read as stored, a quantized checkpoint)
    split the layers' projections only. Norms stay whole on both."""
    gguf = [
        memory.StoredTensor("token_embd.weight", 1000, 2, "F32"),
        memory.StoredTensor("output.weight", 1000, 2, "Q8_0"),
        memory.StoredTensor("blk.0.attn_output.weight", 640, 2, "Q4_0"),
        memory.StoredTensor("blk.0.attn_norm.weight", 10, 1, "F32"),
    ]
    assert memory.read_by_node_loaders(gguf, "auto", gguf=True)
    held = memory.weights_per_device(gguf, "auto", 4, 2, layers_only=True)
    # Q8_0 as 8-bit groups (two 4-bit halves: 1.25 bytes a weight); attn_output.weight a layer's, split
    assert held == 1000 * 4 + 1000 * 1.25 + 10 * 4 + 640 * 0.625 // 2
    plain = [
        memory.StoredTensor("model.embed_tokens.weight", 1000, 2),
        memory.StoredTensor("lm_head.weight", 1000, 2),
        memory.StoredTensor("model.layers.0.self_attn.o_proj.weight", 640, 2),
        memory.StoredTensor("model.norm.weight", 10, 1),
    ]
    assert not memory.read_by_node_loaders(plain, "auto", gguf=False)
    assert not memory.read_by_node_loaders(gguf, "none", gguf=True)
    assert (
        memory.weights_per_device(plain, "none", 4, 2, layers_only=False)
        == 10 * 4 + (2000 + 640) * 4 // 2
    )
