"""Quantized weights on a GPU: tinygemm's int4 layer and the int8 layer compute what the CPU's do
from the same codes; a GGUF file's 4-bit weights load packed for CUDA, and the engine under CUDA
graphs decodes the quantized model as a full forward does."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from node_agent.engine.engine import Engine
from node_agent.model import loader
from node_agent.model.quantized_linear import Int4Linear, Int8Linear
from node_agent.serving import prompts
from tests import gguf_files, tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run


@pytest.mark.parametrize("layer", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("in_features", [576, 1024])  # 576: tinygemm tiles of 16 x 2
def test_a_quantized_layer_on_cuda_computes_what_it_does_on_the_cpu(layer, in_features):
    torch.manual_seed(0)
    weight, x = torch.randn(256, in_features), torch.randn(7, in_features)
    on_cpu, on_cuda = layer.quantize(weight), layer.quantize(weight.cuda())
    want = on_cpu(x)
    assert (on_cuda(x.cuda()).cpu() - want).abs().max() <= 0.01 * want.abs().max()


def test_a_gguf_model_runs_4_bit_on_cuda_under_graphs_as_a_full_forward_does(tmp_path):
    tokenizer = tiny_models.make_tokenizer()
    folder = tiny_models.build("llama", tmp_path / "llama", tokenizer, hidden_size=256, intermediate_size=512,
                               initializer_range=0.05)
    path = gguf_files.write(folder, tmp_path / "llama.gguf", T.Q4_0)
    profile = tiny_profile(path, tokenizer_source=str(folder), dtype="bfloat16", decode="graphs",
                           prefill_chunk_tokens=16)
    lm = loader.load(profile, "cuda")
    assert all(m.weight_packed.is_cuda for m in lm.model.modules() if isinstance(m, Int4Linear))
    requests = [request(f"j{i}", p, temperature=0, max_tokens=10, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    results = run(Engine(lm, profile), *requests)
    for req in requests:
        ids = prompts.prompt_ids(lm.tokenizer, profile, req)
        assert results[req.job].token_ids[0] == full_forward_greedy(lm, ids, 10), req.job
