"""LoRA adapters on a GPU (issue 51): rows of the base and of two adapters of different ranks in one
decode step under CUDA graphs (the slot ids a tensor the captured step reads in place) give, greedy,
what PEFT's merged models give in transformers (float32 full forwards on the GPU); the step stays
captured."""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from node_agent.engine.engine import Engine
from node_agent.model import decoders
from node_agent.serving import prompts
from tests import tiny_models
from tests.gpu.conftest import load
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a4": (4, ALL), "a8": (8, ["q_proj", "v_proj", "o_proj", "down_proj"])}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adapters_in_one_captured_step_equal_peft_merged_models(gpu_tiny_dirs, tmp_path, arch):
    base_dir = gpu_tiny_dirs[arch]
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        tiny_models.save_lora_adapter(base_dir, tmp_path / name, rank, targets, seed)
    profile, lm = load(base_dir, decode="graphs", slots=6, max_loras=2, max_lora_rank=8)
    engine = Engine(lm, profile)
    for name in ADAPTERS:
        engine.load_adapter(name, tmp_path / name)
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to("cuda")
    models = {"": reference}
    for name in ADAPTERS:
        merged = PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path / name)
        models[name] = merged.merge_and_unload().eval()
    reqs = []
    for i, p in enumerate(PROMPTS[:3]):
        for adapter in ["", *ADAPTERS]:
            r = request(
                f"g{i}{adapter or 'base'}", p, temperature=0, max_tokens=10, ignore_eos=True
            )
            r.adapter = adapter
            reqs.append(r)
    results = run(engine, *reqs)
    for r in reqs:
        ids = prompts.prompt_ids(lm.tokenizer, profile, r)
        reference_lm = SimpleNamespace(model=models[r.adapter], device=lm.device)
        want = full_forward_greedy(reference_lm, ids, r.sampling.max_tokens)
        assert results[r.job].token_ids[0] == want, (arch, r.job)
    assert isinstance(engine.decoder, decoders.StaticDecoder) and engine.decoder.graphs
