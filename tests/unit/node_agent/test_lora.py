"""LoRA adapters in mixed batches: PEFT adapters of two ranks (built here with peft, random
weights) served on a tiny base, rows of the base and of both adapters decoding together, greedy
token for token what PEFT's merged model in transformers gives (float32 full forwards); again with
prefix hits (a prompt's blocks cached under one adapter are never a hit for another or the base),
under block pressure (preemption per row), and with one device slot (adapters swapped in and out).
Adapters that cannot be served are refused at load with why, and the base's requests go on."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from node_agent.engine.engine import Engine
from node_agent.model import loader
from node_agent.serving import prompts
from shared.errors import AdapterLoadFailed
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, run
from tests.unit.node_agent.engine_driver import request as job_request

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a4": (4, ALL), "a8": (8, ["q_proj", "v_proj", "o_proj", "down_proj"])}


save_adapter = tiny_models.save_lora_adapter


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, small_vocab_dirs, tmp_path_factory):
    arch = request.param
    base_dir = small_vocab_dirs[arch]
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        save_adapter(base_dir, root / name, rank, targets, seed)
    profile = tiny_profile(base_dir, prefill_chunk_tokens=16, slots=6, max_loras=2, max_lora_rank=8)
    lm = loader.load(profile, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    models = {"": reference}
    for name in ADAPTERS:
        merged = PeftModel.from_pretrained(copy.deepcopy(reference), root / name)
        models[name] = merged.merge_and_unload().eval()
    return SimpleNamespace(profile=profile, lm=lm, root=root, models=models, base_dir=base_dir)


def requests_for(s, tag: str, count: int = 4, max_tokens: int = 8) -> list:
    reqs = []
    for i, p in enumerate(PROMPTS[:count]):
        for adapter in ["", *ADAPTERS]:
            r = job_request(
                f"{tag}{i}{adapter or 'base'}", f"{p} {p}", temperature=0, max_tokens=max_tokens
            )
            r.sampling.ignore_eos = True
            r.adapter = adapter
            reqs.append(r)
    return reqs


def expected(s, reqs) -> dict[str, list[int]]:
    out = {}
    for r in reqs:
        ids = prompts.prompt_ids(s.lm.tokenizer, s.profile, r)
        model = SimpleNamespace(model=s.models[r.adapter], device=torch.device("cpu"))
        out[r.job] = full_forward_greedy(model, ids, r.sampling.max_tokens)
    return out


def engine_with_adapters(s, **update) -> Engine:
    engine = Engine(s.lm, s.profile.model_copy(update=update))
    for name in ADAPTERS:
        engine.load_adapter(name, s.root / name)
    return engine


def tokens(results) -> dict[str, list[int]]:
    return {job: r.token_ids[0] for job, r in results.items()}


def test_mixed_batches_equal_peft_merged_models(setup):
    s = setup
    reqs = requests_for(s, "m")
    want = expected(s, reqs)
    # the adapters change what the base says: the test can fail
    for i in range(4):
        assert want[f"m{i}a4"] != want[f"m{i}base"] and want[f"m{i}a8"] != want[f"m{i}base"]
    engine = engine_with_adapters(s)
    assert tokens(run(engine, *reqs, join_every=1)) == want
    # again, the same prompts: prefix hits, each under its own adapter's blocks
    hits = engine.kv_stats().prefix_hits
    again = requests_for(s, "m")
    assert tokens(run(engine, *again)) == want
    assert engine.kv_stats().prefix_hits > hits


def test_one_slot_swaps_adapters_and_preemption_is_per_row(setup):
    s = setup
    reqs = requests_for(s, "p", count=2, max_tokens=24)
    want = expected(s, reqs)
    engine = engine_with_adapters(s, max_loras=1, kv_cache_mb=None)
    longest = max(len(prompts.prompt_ids(s.lm.tokenizer, s.profile, r)) for r in reqs)
    size = s.profile.block_size
    blocks = 2 * -(-(longest + 1) // size) + 1  # two prompts at once, not their 24 tokens each
    assert blocks >= -(-(longest + 24) // size)  # one sequence alone finishes
    engine.pool.__init__(blocks, size)
    assert tokens(run(engine, *reqs)) == want
    assert engine.kv_stats().preemptions > 0 and engine.pool.used == 0


def test_adapters_that_cannot_be_served_are_refused_and_the_base_goes_on(setup, tmp_path):
    s = setup
    engine = engine_with_adapters(s)
    save_adapter(s.base_dir, tmp_path / "big", 16, ["q_proj"], 5)
    with pytest.raises(AdapterLoadFailed, match="rank 16 is over this model's max_lora_rank"):
        engine.load_adapter("big", tmp_path / "big")
    with pytest.raises(AdapterLoadFailed, match="no adapter_config.json"):
        engine.load_adapter("missing", tmp_path / "nowhere")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterLoadFailed, match="corrupt"):
        engine.load_adapter("corrupt", tmp_path / "corrupt")
    other = tmp_path / "other-base"  # a base of another width
    AutoModelForCausalLM.from_config(
        s.models[""].config.__class__(**{**s.models[""].config.to_dict(), "hidden_size": 32})
    ).save_pretrained(other)
    save_adapter(other, tmp_path / "wrong", 4, ["q_proj"], 6)
    with pytest.raises(AdapterLoadFailed, match="another base"):
        engine.load_adapter("wrong", tmp_path / "wrong")
    unloaded = job_request("x", "Hello there", temperature=0, max_tokens=4)
    unloaded.adapter = "big"
    with pytest.raises(AdapterLoadFailed, match="not loaded"):
        engine.add(unloaded, prompts.prompt_ids(s.lm.tokenizer, s.profile, unloaded), 0.0)
    base = [r for r in requests_for(s, "b") if not r.adapter]
    assert tokens(run(engine, *base)) == expected(s, base)


def test_a_quantized_base_refuses_adapters_with_why(small_vocab_dirs, tmp_path):
    profile = tiny_profile(small_vocab_dirs["llama"], quant="int8", max_loras=1)
    engine = Engine(loader.load(profile, "cpu"), profile)
    save_adapter(small_vocab_dirs["llama"], tmp_path / "a", 4, ["q_proj"], 1)
    with pytest.raises(AdapterLoadFailed, match="not quantized ones"):
        engine.load_adapter("a", tmp_path / "a")
