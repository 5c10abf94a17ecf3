"""The engine on a GPU: greedy output under CUDA graphs (paged decode: block tables read inside the
captured step) equals full-forward greedy decoding (fp32) for full, sliding-window and
linear-attention layers, with prefix hits and preemption too; captured steps equal uncaptured ones
bit for bit, compiled steps agree, a model that cannot be captured falls back to eager and stays
right."""

import pytest

from node_agent.engine.engine import Engine
from node_agent.model import decoders
from node_agent.serving import prompts
from tests.gpu.conftest import ARCHS, load
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run


def requests(n_tokens: int = 12):
    return [
        request(f"j{i}", p, temperature=0, max_tokens=n_tokens + i, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_under_graphs_matches_full_forward_greedy(gpu_tiny_dirs, arch):
    profile, lm = load(gpu_tiny_dirs[arch], prefill_chunk_tokens=16, decode="graphs")
    engine = Engine(lm, profile)
    results = run(engine, *requests())
    for req in requests():
        ids = prompts.prompt_ids(lm.tokenizer, profile, req)
        assert results[req.job].token_ids[0] == full_forward_greedy(
            lm, ids, req.sampling.max_tokens
        ), (arch, req.messages)
    if (
        arch != "qwen3_moe"
    ):  # its experts route with host syncs: it falls back to eager (and stays right)
        assert isinstance(engine.decoder, decoders.StaticDecoder) and engine.decoder.graphs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_steps_equal_uncaptured_steps(gpu_tiny_dirs, arch):
    profile, lm = load(gpu_tiny_dirs[arch], dtype="bfloat16")
    sampled = [
        request(f"s{i}", p, temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    static = run(Engine(lm, profile.model_copy(update={"decode": "static"})), *requests(), *sampled)
    graphs = run(Engine(lm, profile.model_copy(update={"decode": "graphs"})), *requests(), *sampled)
    assert {j: r.token_ids for j, r in graphs.items()} == {
        j: r.token_ids for j, r in static.items()
    }


def test_compiled_steps_agree_with_eager(gpu_tiny_dirs):
    profile, lm = load(gpu_tiny_dirs["llama"])
    eager = run(Engine(lm, profile.model_copy(update={"decode": "eager"})), *requests())
    compiled = run(Engine(lm, profile.model_copy(update={"decode": "compiled"})), *requests())
    assert {j: r.token_ids for j, r in compiled.items()} == {
        j: r.token_ids for j, r in eager.items()
    }


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_prefix_hits_and_preemption_under_graphs_match_full_forward_greedy(gpu_tiny_dirs, arch):
    profile, lm = load(gpu_tiny_dirs[arch], prefill_chunk_tokens=16, decode="graphs", block_size=8)
    engine = Engine(lm, profile)
    engine.pool.__init__(
        24, 8
    )  # 192 tokens: six prompts of ~40 and their answers cannot all run at once
    first = run(engine, *requests(24))
    again = run(
        engine,
        *[r.model_copy(update={"job": r.job + "-again"}) for r in requests(24)],
        join_every=1,
    )
    stats = engine.kv_stats()
    assert stats.prefix_hits > 0 and stats.preemptions > 0 and stats.blocks_used == 0
    for req in requests(24):
        ids = prompts.prompt_ids(lm.tokenizer, profile, req)
        expected = full_forward_greedy(lm, ids, req.sampling.max_tokens)
        assert (
            first[req.job].token_ids[0] == expected
            and again[req.job + "-again"].token_ids[0] == expected
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_speculation_verifies_drafts_in_captured_graphs(gpu_tiny_dirs, arch):
    """A step with draft tokens replays a captured verify step (rows x width x cache columns) and
    keeps the greedy output of the engine without speculation."""
    profile, lm = load(gpu_tiny_dirs[arch], decode="graphs")
    repeated = request(
        "repeated",
        "one two three four " * 8,
        kind="completion",
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
    )
    plain = run(Engine(lm, profile), *requests(), repeated)
    engine = Engine(
        lm,
        profile.model_copy(
            update={
                "speculative": "ngram",
                "num_speculative_tokens": 4,
                "speculative_max_batch": profile.slots,
            }
        ),
    )
    fast = run(engine, *requests(), repeated)
    assert {j: r.token_ids for j, r in fast.items()} == {j: r.token_ids for j, r in plain.items()}
    assert engine.spec_stats().drafts > 0 and any(len(key) == 3 for key in engine.decoder.graphs)
