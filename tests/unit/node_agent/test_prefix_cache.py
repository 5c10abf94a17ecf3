"""Paged KV at the engine: a prompt's cached prefix is reused (and gives the tokens a cold run
gives), the sequences of an n > 1 job share the prompt's blocks, sequences run while blocks last
and are preempted and recomputed when they run out (finishing with the tokens they would have had
unpressured), and a prompt the whole cache cannot hold is refused."""

import pytest

from node_agent.engine.engine import Engine
from node_agent.model import loader
from shared import prefix_marks
from shared.errors import ContextLengthExceeded
from shared.wire import DeltaEvent
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, add, request, run

SYSTEM = " ".join(PROMPTS) * 2  # a long shared start, as an agent's system prompt


def chat(job: str, *turns: str, **sampling) -> object:
    req = request(job, temperature=0, ignore_eos=True, **{"max_tokens": 12} | sampling)
    req.messages = [{"role": "system", "content": SYSTEM}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return req


def tokens(results) -> dict:
    return {job: r.token_ids for job, r in results.items()}


def test_a_cached_prefix_gives_the_tokens_of_a_cold_run(tiny_llama):
    profile, lm = tiny_llama
    first, later = chat("t1", "Hello there"), chat("t2", "Hello there", "Hi!", "Why?")
    cold = tokens(run(Engine(lm, profile), later))
    engine = Engine(lm, profile)
    run(engine, first)
    before = engine.kv_stats()
    warm = run(engine, later)
    stats = engine.kv_stats()
    assert tokens(warm) == cold
    assert (
        stats.prefix_hits - before.prefix_hits >= 3 * profile.block_size
    )  # the system prompt's blocks at least
    assert (
        warm["t2"].done.usage.cached_tokens == stats.prefix_hits - before.prefix_hits
    )  # reported to the client
    assert stats.blocks_used == 0 and stats.blocks_cached > 0


def test_prefix_hits_mid_batch_equal_cold_runs(tiny_llama):
    profile, lm = tiny_llama
    reqs = [chat(f"j{i}", p) for i, p in enumerate(PROMPTS)]
    cold = {r.job: tokens(run(Engine(lm, profile), r))[r.job] for r in reqs}
    engine = Engine(lm, profile)
    assert (
        tokens(run(engine, *reqs, join_every=2)) == cold
    )  # each later one joins a running batch, hitting the system prompt
    assert engine.kv_stats().prefix_hits > 0


def test_the_sequences_of_one_job_share_the_prompts_blocks(tiny_llama):
    profile, lm = tiny_llama
    req = chat("n4", "Hello there", n=4, max_tokens=4)
    engine = Engine(lm, profile)
    add(engine, req)
    prompt = len(engine.scheduler.jobs["n4"].sequences[0].tokens)
    size, used = profile.block_size, []
    while engine.has_work:
        engine.step()
        used.append(engine.pool.used)
    own = -(-(prompt + 1) // size)  # the first sequence's blocks: its prompt and one token
    shared = (
        prompt // size if prompt % size else prompt // size - 1
    )  # its full blocks, less one token to read
    assert max(used) == own + 3 * (own - shared)
    assert max(used) < 4 * own / 2
    alone = tokens(run(Engine(lm, profile), chat("n1", "Hello there", max_tokens=4)))["n1"][0]
    assert all(t == alone for t in tokens(run(Engine(lm, profile), req))["n4"].values())


def test_preemption_under_block_pressure_finishes_every_sequence_as_unpressured(tiny_llama):
    profile, lm = tiny_llama
    reqs = [chat(f"j{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)]
    unpressured = tokens(run(Engine(lm, profile), *reqs))
    prompt = max(len(s.tokens) for r in reqs[:1] for s in _queued(lm, profile, r))
    blocks = (
        2 * -(-(prompt + 40) // profile.block_size) + 1
    )  # two sequences' worth: six jobs run in turns
    tight = profile.model_copy(update={"kv_cache_mb": None})
    engine = Engine(lm, tight)
    engine.pool.__init__(blocks, profile.block_size)  # a tiny budget
    assert tokens(run(engine, *reqs)) == unpressured
    assert engine.kv_stats().preemptions > 0 and engine.pool.used == 0


def _queued(lm, profile, req):
    engine = Engine(lm, profile)
    add(engine, req)
    return engine.scheduler.jobs[req.job].sequences


def test_a_prompt_the_whole_cache_cannot_hold_is_refused(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"kv_cache_mb": 1, "block_size": 16}))
    engine.pool.__init__(2, 16)  # 32 tokens in all
    with pytest.raises(ContextLengthExceeded, match="KV cache holds 32 tokens"):
        add(engine, chat("long", "Hello there"))
    assert not engine.has_work and not engine.jobs


def test_hybrid_linear_attention_models_never_reuse_a_prefix(small_vocab_dirs):
    profile = tiny_profile(small_vocab_dirs["qwen3_5_text"], slots=4)
    lm = loader.load(profile, "cpu")
    cold = tokens(run(Engine(lm, profile), chat("b", "Hello there", "Hi!", "Why?")))
    engine = Engine(lm, profile)
    run(engine, chat("a", "Hello there"))
    assert tokens(run(engine, chat("b", "Hello there", "Hi!", "Why?"))) == cold
    assert engine.kv_stats().prefix_hits == 0


def test_64_long_prompts_run_together_in_a_budget_of_16_full_contexts(tmp_path, smol_tokenizer):
    """max_model_len 32768 and a KV budget of 16 x 4,096 tokens: 64 sequences of 800 tokens all
    decode together (slots of 32768 columns would have held 2 of them), greedy-equal to running alone."""
    folder = tiny_models.build(
        "llama",
        tmp_path / "long",
        smol_tokenizer,
        max_position_embeddings=32768,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
    )
    per_token = 2 * 1 * 2 * 8 * 4  # keys and values, 1 layer, 2 heads of 8, fp32
    profile = tiny_profile(
        folder,
        slots=64,
        max_model_len=32768,
        prefill_chunk_tokens=8192,
        kv_cache_mb=16 * 4096 * per_token // (1 << 20),
    )
    lm = loader.load(profile, "cpu")
    prompts = {
        f"r{i}": [(i * 7919 + k * 104729) % 40000 + 100 for k in range(800)] for i in range(64)
    }

    def start(engine: Engine, job: str) -> None:
        engine.add(
            request(job, kind="completion", temperature=0, max_tokens=24, ignore_eos=True),
            prompts[job],
            0.0,
        )

    def finish(engine: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        while engine.has_work:
            for job, events in engine.step():
                out.setdefault(job, []).extend(
                    t
                    for e in events
                    if isinstance(e, DeltaEvent)
                    for c in e.choices
                    for t in c.token_ids
                )
            decoding.append(engine.scheduler.n_decoding)
        return out

    engine, decoding = Engine(lm, profile), []
    assert engine.pool.blocks * engine.pool.block_size == 16 * 4096
    for job in prompts:
        start(engine, job)
    together = finish(engine)
    assert max(decoding) == 64 and engine.kv_stats().preemptions == 0
    for job in ["r0", "r31", "r63"]:
        alone = Engine(lm, profile)
        start(alone, job)
        assert finish(alone)[job] == together[job]


def _marked(job: str, *turns: str, **sampling):
    req = chat(job, *turns, **sampling)
    req.prefix_marks = prefix_marks.marks(req)
    return req


def _drive(engine: Engine, *requests) -> tuple[list[tuple[str, int]], list[str]]:
    """Run `requests` to their end; the prefix marks the engine's records said were held and dropped."""
    for req in requests:
        add(engine, req)
    held, dropped = [], []
    while engine.has_work:
        out = engine.core_step()
        held += out.held
        dropped += out.dropped
        engine.stop(engine.output.process(out)[1])
    return held, dropped


def test_the_engine_reports_the_prefix_marks_its_cache_holds_until_their_blocks_are_evicted(
    tiny_llama,
):
    profile, lm = tiny_llama
    engine = Engine(lm, profile)
    req = _marked("m1", "Hello there", max_tokens=2)
    held, dropped = _drive(engine, req)
    prompt = engine.kv_stats().prefix_queries
    marks = [mark for mark, _ in req.prefix_marks]
    assert [mark for mark, _ in held] == marks and held[-1][1] == prompt and dropped == []
    assert 0 < held[0][1] < prompt  # the system prompt's share of the prompt
    assert _drive(engine, _marked("m2", "Hello there", max_tokens=2)) == (
        [],
        [],
    )  # held already: nothing new
    evicted = set()
    for i in range(
        40
    ):  # other conversations fill the cache until the first one's blocks are evicted
        other = _marked(f"o{i}", "Hello there", max_tokens=1)
        other.messages[0]["content"] = f"{i} {SYSTEM}"
        other.prefix_marks = prefix_marks.marks(other)
        evicted |= set(_drive(engine, other)[1])
        if set(marks) <= evicted:
            break
    assert set(marks) <= evicted


def test_jobs_without_marks_or_with_caching_off_report_none(tiny_llama):
    profile, lm = tiny_llama
    assert _drive(Engine(lm, profile), chat("plain", "Hello there", max_tokens=2)) == ([], [])
    off = Engine(lm, profile.model_copy(update={"prefix_caching": False}))
    assert _drive(off, _marked("off", "Hello there", max_tokens=2)) == ([], [])


def test_a_prompt_finds_cached_only_the_blocks_of_prompts_with_its_cache_salt(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile)
    run(engine, chat("a1", "Hello there", max_tokens=2).model_copy(update={"cache_salt": "alice"}))
    other = run(
        engine, chat("b1", "Hello there", max_tokens=2).model_copy(update={"cache_salt": "bob"})
    )
    unsalted = run(engine, chat("u1", "Hello there", max_tokens=2))
    same = run(
        engine, chat("a2", "Hello there", max_tokens=2).model_copy(update={"cache_salt": "alice"})
    )
    assert (
        other["b1"].done.usage.cached_tokens == 0 and unsalted["u1"].done.usage.cached_tokens == 0
    )
    assert same["a2"].done.usage.cached_tokens >= 3 * profile.block_size
    assert tokens(same)["a2"] == tokens(other)["b1"]  # the same answer, cached or not
