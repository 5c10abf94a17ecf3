"""Quantized weights on a GPU: tinygemm's int4 layer, the int8 layer and the float8 layer (FP8
matmuls) compute what the CPU's do from the same codes; a GGUF file's 4-bit weights load packed for
CUDA; quant = "fp8" and an FP8 checkpoint run FP8 matmuls where the GPU has them; and the engine
under CUDA graphs decodes each quantized model as a full forward does."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from node_agent.engine.engine import Engine
from node_agent.model import loader
from node_agent.model.quantized_linear import Float8Linear, Int4Linear, Int8Linear
from node_agent.serving import prompts
from tests import gguf_files, tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run
from tests.unit.node_agent.test_checkpoint_quant import (
    FP8_MATMUL_BOUND,
    last_logits,
    write_checkpoint,
)

HAS_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(
    not HAS_FP8,
    reason="no GPU with FP8 matmuls here (compute capability 8.9+: Ada, Hopper, Blackwell)",
)


@pytest.mark.parametrize("layer", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("in_features", [576, 1024])  # 576: tinygemm tiles of 16 x 2
def test_a_quantized_layer_on_cuda_computes_what_it_does_on_the_cpu(layer, in_features):
    torch.manual_seed(0)
    weight, x = torch.randn(256, in_features), torch.randn(7, in_features)
    on_cpu, on_cuda = layer.quantize(weight), layer.quantize(weight.cuda())
    want = on_cpu(x)
    assert (on_cuda(x.cuda()).cpu() - want).abs().max() <= 0.01 * want.abs().max()


@needs_fp8
@pytest.mark.parametrize("in_features", [576, 1024])
def test_a_float8_layer_on_cuda_computes_the_product_of_its_codes(in_features):
    # (torch's CPU `_scaled_mm` takes per-row scales only from 2.12 on: the reference is the codes' product in float32)
    torch.manual_seed(0)
    weight, x = (
        torch.randn(256, in_features, device="cuda"),
        torch.randn(7, in_features, device="cuda"),
    )
    layer = Float8Linear.quantize(weight)
    largest = x.abs().amax(-1, keepdim=True)
    x_codes = (x * (448 / largest)).to(torch.float8_e4m3fn)
    want = (x_codes.float() * largest / 448) @ (
        layer.weight_fp8.float() * layer.weight_scale.t() * 448
    ).t()
    got = layer(x)
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 0.01 * want.abs().max()
    assert (
        got - x @ weight.t()
    ).abs().max() <= 0.1 * want.abs().max()  # float8 itself: measured 0.043 on a CPU


def test_a_gguf_model_runs_4_bit_on_cuda_under_graphs_as_a_full_forward_does(tmp_path):
    tokenizer = tiny_models.make_tokenizer()
    folder = tiny_models.build(
        "llama",
        tmp_path / "llama",
        tokenizer,
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.05,
    )
    path = gguf_files.write(folder, tmp_path / "llama.gguf", T.Q4_0)
    profile = tiny_profile(
        path,
        tokenizer_source=str(folder),
        dtype="bfloat16",
        decode="graphs",
        prefill_chunk_tokens=16,
    )
    lm = loader.load(profile, "cuda")
    assert all(m.weight_packed.is_cuda for m in lm.model.modules() if isinstance(m, Int4Linear))
    _decodes_as_a_full_forward(lm, profile)


def _decodes_as_a_full_forward(lm, profile) -> None:
    requests = [
        request(f"j{i}", p, temperature=0, max_tokens=10, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    results = run(Engine(lm, profile), *requests)
    for req in requests:
        ids = prompts.prompt_ids(lm.tokenizer, profile, req)
        assert results[req.job].token_ids[0] == full_forward_greedy(lm, ids, 10), req.job


@needs_fp8
def test_quant_fp8_runs_fp8_matmuls_under_graphs_as_a_full_forward_does(tmp_path):
    tokenizer = tiny_models.make_tokenizer()
    folder = tiny_models.build(
        "qwen3",
        tmp_path / "qwen3",
        tokenizer,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        initializer_range=0.05,
    )
    profile = tiny_profile(folder, dtype="bfloat16", decode="graphs", prefill_chunk_tokens=16)
    full = loader.load(profile.model_copy(update={"quant": "none"}), "cuda")
    lm = loader.load(profile.model_copy(update={"quant": "fp8"}), "cuda")
    layers = [m for m in lm.model.modules() if isinstance(m, Float8Linear)]
    assert lm.quant == "fp8" and len(layers) == 14 and lm.weight_bytes < full.weight_bytes
    ids = lm.tokenizer("The capital of France is Paris. Write a poem.")["input_ids"]
    got, want = last_logits(lm, ids), last_logits(full, ids)
    assert (got - want).abs().max() <= FP8_MATMUL_BOUND * want.abs().max()
    _decodes_as_a_full_forward(lm, profile)


@needs_fp8
def test_an_fp8_checkpoint_loads_into_fp8_matmuls_on_cuda(tmp_path):
    tokenizer = tiny_models.make_tokenizer()
    base = tiny_models.build(
        "llama",
        tmp_path / "llama",
        tokenizer,
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.05,
    )
    stored_folder, reference_folder = write_checkpoint(base, tmp_path, "fp8_block")
    profile = tiny_profile(
        stored_folder, dtype="bfloat16", decode="graphs", prefill_chunk_tokens=16
    )
    lm, reference = (
        loader.load(profile, "cuda"),
        loader.load(tiny_profile(reference_folder, dtype="bfloat16"), "cuda"),
    )
    assert lm.quant == "fp8" and sum(isinstance(m, Float8Linear) for m in lm.model.modules()) == 14
    ids = lm.tokenizer("The capital of France is Paris. Write a poem.")["input_ids"]
    got, want = last_logits(lm, ids), last_logits(reference, ids)
    assert (got - want).abs().max() <= FP8_MATMUL_BOUND * want.abs().max()
    _decodes_as_a_full_forward(lm, profile)
