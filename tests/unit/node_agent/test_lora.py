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
import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from node_agent.engine.engine import Engine
from node_agent.model import loader, lora_layers, quantized_linear
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


def test_the_compiled_step_serves_mixed_batches_in_the_graph_it_was_compiled_to(setup):
    """A CPU node's decode step compiled (node_agent/model/compiled_step.py) with adapter slots:
    rows of the base and both adapters joining one at a time (each slot's group of another size
    every few steps) give PEFT's merged models' tokens, all from the graph compiled at load."""
    s = setup
    reqs = requests_for(s, "c", count=3)
    engine = engine_with_adapters(s, decode="compiled")
    assert engine.decoder.name == "compiled"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert tokens(run(engine, *reqs, join_every=1)) == expected(s, reqs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert not engine.decoder.step.eager


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


def _int4_reference(base_dir, adapter_dir):
    """transformers' model with its Linear layers but the head rounded as a node's 4-bit layers
    round them (quantized_linear.round_int4) and read back in float32, and the adapter's update added
    to each targeted layer's output by a hook, from PEFT's files (`adapter_dir` None: the base)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear and module is not head:
                module.weight.copy_(_read_back_int4(module.weight))
    if adapter_dir is not None:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        weights = safetensors.torch.load_file(adapter_dir / "adapter_model.safetensors")
        for name, module in model.named_modules():
            if (a := weights.get(f"base_model.model.{name}.lora_A.weight")) is not None:
                b = weights[f"base_model.model.{name}.lora_B.weight"]
                module.register_forward_hook(
                    lambda _, args, out, a=a, b=b: out + scale * (args[0] @ a.T @ b.T)
                )
    return model.eval()


def _read_back_int4(weight: torch.Tensor) -> torch.Tensor:
    codes, scale, zero = quantized_linear.round_int4(weight)
    groups = codes.float().reshape(weight.shape[0], -1, quantized_linear.GROUP)
    return ((groups - 8) * scale[..., None] + zero[..., None]).reshape(weight.shape)


def test_adapters_on_a_quantized_base_follow_the_quantized_reference(small_vocab_dirs, tmp_path):
    """The base's layers stay 4-bit; each adapter's update is added in full precision. Greedy tokens
    of the base and two adapters in one mixed batch follow the reference (the rounded weights read
    back in float32, each request alone, the update added by hooks from PEFT's files) within the
    kernels' bfloat16 activations: at most one row of the twelve parts from it."""
    base_dir = small_vocab_dirs["llama"]
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        save_adapter(base_dir, tmp_path / name, rank, targets, seed)
    profile = tiny_profile(base_dir, quant="int4", slots=6, max_loras=2, max_lora_rank=8)
    lm = loader.load(profile, "cpu")
    assert quantized_linear.held_as(lm.model) == "int4"
    reference = {"": _int4_reference(base_dir, None)}
    for name in ADAPTERS:
        reference[name] = _int4_reference(base_dir, tmp_path / name)
    s = SimpleNamespace(profile=profile, lm=lm, root=tmp_path, models=reference)
    reqs = requests_for(s, "q")
    want = expected(s, reqs)
    engine = engine_with_adapters(s)
    got = tokens(run(engine, *reqs, join_every=1))
    apart = [job for job in want if got[job] != want[job]]
    assert len(apart) <= 1, (apart, {job: (got[job], want[job]) for job in apart})
    for i in range(4):  # the adapters change what the quantized base says
        assert got[f"q{i}a4"] != got[f"q{i}base"] and got[f"q{i}a8"] != got[f"q{i}base"]


@pytest.mark.parametrize("kind", ["int4", "int8-weights", "int8-dynamic"])
def test_a_quantized_layer_gets_each_tokens_adapter_update_in_full_precision(kind):
    """One layer of each quantized kind a CPU serves: a token of slot 0 (the base) gets what the
    quantized layer gives; a token of an adapter's slot gets that plus its scaled B @ A @ x, computed
    here in float32 apart from the layer."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False)
    if kind == "int4":
        base = quantized_linear.Int4Linear.quantize(linear.weight.detach())
    elif kind == "int8-weights":
        base = quantized_linear.Int8Linear.quantize(linear.weight.detach())
    else:
        holder = torch.nn.Sequential(linear)  # as loader.quantize_int8_dynamic quantizes a model
        torch.ao.quantization.quantize_dynamic(
            holder,
            {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
            inplace=True,
        )
        base = holder[0]
    state = lora_layers.LoraState(2, 3, 4, torch.float32, torch.device("cpu"))
    layer = lora_layers.LoraLinear(base, [96], 64, state)
    a, b = torch.randn(4, 64), torch.randn(96, 4) * 0.5
    layer.place(0, 2, a, b)
    x = torch.randn(3, 1, 64)
    state.ids = torch.tensor([[0], [2], [1]])  # base, the adapter, an empty slot
    got = layer(x)
    plain = base(x)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])
    torch.testing.assert_close(got[1], plain[1] + x[1] @ a.T @ b.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "batched-matmuls"])
def test_each_token_gets_its_own_slots_update_through_every_part(kernel):
    """A layer of three parts (a stacked q/k/v's widths, one wider than the kernel's stretch of
    columns) over tokens of the base, two adapters (one of a lower rank) and an empty slot, in a
    [rows, tokens] grid of more tokens a slot than the kernel's block: each token gets its own slot's
    update in each part, by the CPU kernel and by the batched matmuls a GPU runs."""
    if kernel and not lora_layers._kernel():
        pytest.skip("the node's C++ CPU kernels could not be built here (no compiler)")
    torch.manual_seed(0)
    widths, rank = [600, 32, 48], 4
    base = torch.nn.Linear(64, sum(widths), bias=False)
    state = lora_layers.LoraState(3, 4, rank, torch.float32, torch.device("cpu"), kernel)
    layer = lora_layers.LoraLinear(base, widths, 64, state)
    update = {}
    for slot, used in ((1, rank), (2, rank - 1)):  # slot 3 empty
        a = [torch.randn(used, 64) for _ in widths]
        b = [torch.randn(width, used) * 0.5 for width in widths]
        for part in range(len(widths)):
            layer.place(part, slot, a[part], b[part])
        update[slot] = lambda x, a=a, b=b: torch.cat([x @ ai.T @ bi.T for ai, bi in zip(a, b)], -1)
    state.ids = torch.tensor([[0, 1, 2, 1, 3, 1, 1], [2, 2, 0, 1, 1, 2, 2], [1, 1, 1, 0, 2, 2, 3]])
    x = torch.randn(3, 7, 64)
    got, plain = layer(x), base(x)
    for row in range(3):
        for column in range(7):
            slot = state.ids[row, column].item()
            want = plain[row, column] + (update[slot](x[row, column]) if slot in update else 0)
            torch.testing.assert_close(got[row, column], want, rtol=1e-5, atol=1e-4)
