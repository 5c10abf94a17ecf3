import pytest
import torch

from node_agent.engine.engine import Engine
from node_agent.serving import prompts
from shared.errors import ContextLengthExceeded
from tests.unit.node_agent.engine_driver import PROMPTS, add, request, run


def test_batched_equals_alone_with_arrivals_mid_stream(tiny_llama):
    profile, lm = tiny_llama
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone[i] = run(Engine(lm, profile), request(f"a{i}", p, temperature=0, max_tokens=20))[
            f"a{i}"
        ].token_ids
    engine = Engine(lm, profile)
    for i, p in enumerate(PROMPTS[:3]):
        add(engine, request(f"b{i}", p, temperature=0, max_tokens=20))
    got: dict[str, list[int]] = {f"b{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while engine.has_work:
        if steps == 3:  # late arrivals join a running batch
            for i, p in enumerate(PROMPTS[3:], start=3):
                add(engine, request(f"b{i}", p, temperature=0, max_tokens=20))
        for job, events in engine.step():
            for e in events:
                if e.type == "delta":
                    got[job] += [t for c in e.choices for t in c.token_ids]
        steps += 1
    for i in range(len(PROMPTS)):
        assert got[f"b{i}"] == alone[i][0]


def test_prompts_read_together_with_nothing_decoding_run_as_one_packed_forward(
    tiny_llama, monkeypatch
):
    """Prompts that arrive together are read a chunk budget at a time with no row decoding yet (a
    step may end one prompt and start the next): each such step is one packed forward, never the
    padded forward over every chunk's width, and each prompt's tokens are the ones it gets alone."""
    profile, lm = tiny_llama
    profile = profile.model_copy(update={"prefill_chunk_tokens": 16})
    alone = {
        i: run(Engine(lm, profile), request(f"a{i}", p, temperature=0, max_tokens=8))[
            f"a{i}"
        ].token_ids
        for i, p in enumerate(PROMPTS)
    }
    engine = Engine(lm, profile)
    assert engine.runner.calls.packs
    calls = {"packed_forward": 0, "forward": 0}

    def counted(name):
        original = getattr(type(engine.runner.calls), name)

        def call(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(type(engine.runner.calls), name, counted(name))
    results = run(
        engine, *[request(f"b{i}", p, temperature=0, max_tokens=8) for i, p in enumerate(PROMPTS)]
    )
    assert calls["packed_forward"] > 0 and calls["forward"] == 0  # `forward`: the padded one
    assert {i: results[f"b{i}"].token_ids for i in range(len(PROMPTS))} == alone


def test_more_jobs_than_slots_wait_and_finish(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"slots": 2}))
    results = run(
        engine, *[request(f"j{i}", p, temperature=0, max_tokens=5) for i, p in enumerate(PROMPTS)]
    )
    assert all(r.done is not None for r in results.values())
    assert engine.scheduler.rows == [] and not engine.jobs and engine.pool.used == 0


def test_seeded_sampling_reproduces_and_unseeded_varies(tiny_llama):
    profile, lm = tiny_llama

    def once(job, **kw):
        return run(
            Engine(lm, profile),
            request(job, "Hi", temperature=1.0, max_tokens=16, ignore_eos=True, **kw),
        )[job]

    assert once("a", seed=7).token_ids == once("b", seed=7).token_ids
    assert once("c", seed=7).token_ids != once("d", seed=8).token_ids


def test_n_choices_and_usage(tiny_llama):
    profile, lm = tiny_llama
    res = run(
        Engine(lm, profile),
        request("j", "Hi", temperature=1.0, seed=1, n=3, max_tokens=6, ignore_eos=True),
    )["j"]
    assert sorted(res.text) == [0, 1, 2]
    assert all(res.finish[i] == "length" for i in range(3))
    assert res.done.usage.completion_tokens == 18


def test_max_tokens_one_finishes_with_length(tiny_llama):
    profile, lm = tiny_llama
    res = run(
        Engine(lm, profile), request("j", "Hi", temperature=0, max_tokens=1, ignore_eos=True)
    )["j"]
    assert res.finish[0] == "length" and len(res.token_ids[0]) == 1


def test_stop_string_across_tokens_is_not_emitted(tiny_llama):
    profile, lm = tiny_llama
    free = run(
        Engine(lm, profile), request("a", "Hi", temperature=0, max_tokens=30, ignore_eos=True)
    )["a"].text[0]
    stop = free[5:9]  # a stop string that starts mid-text and likely spans tokens
    assert len(stop) == 4
    res = run(
        Engine(lm, profile),
        request("b", "Hi", temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
    )["b"]
    assert res.finish[0] == "stop"
    assert res.text[0] == free[: free.index(stop)]


def test_logprobs_shape_and_values(tiny_llama):
    profile, lm = tiny_llama
    res = run(
        Engine(lm, profile),
        request("j", "Hi", temperature=0, max_tokens=4, logprobs=True, top_logprobs=3),
    )["j"]
    lps = res.logprobs[0]
    assert len(lps) == len(res.token_ids[0])
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)  # greedy picks the best
        assert [t.logprob for t in lp.top_logprobs] == sorted(
            (t.logprob for t in lp.top_logprobs), reverse=True
        )


def test_cancel_frees_the_slot_and_emits_nothing_more(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile)
    add(engine, request("a", "Hi", temperature=0, max_tokens=50, ignore_eos=True))
    add(engine, request("b", "Hello", temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    assert engine.cancel("a")
    jobs = set()
    while engine.has_work:
        jobs |= {job for job, _ in engine.step()}
    assert (
        jobs == {"b"} and engine.scheduler.rows == [] and not engine.jobs and engine.pool.used == 0
    )


def test_context_length_is_checked_before_any_device_work(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile)
    with pytest.raises(ContextLengthExceeded):
        add(engine, request("j", "word " * 400, max_tokens=5))
    with pytest.raises(ContextLengthExceeded):
        add(engine, request("k", "Hi", max_tokens=10_000))
    assert not engine.has_work


def test_prompt_logprobs_score_every_prompt_token_across_chunks(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"prefill_chunk_tokens": 16}))  # several chunks
    req = request(
        "j",
        "Tell me about transformers and attention in detail please",
        temperature=0,
        max_tokens=2,
        prompt_logprobs=2,
    )
    ids = prompts.prompt_ids(lm.tokenizer, profile, req)
    add(engine, req)
    first = None
    while engine.has_work:
        for _, events in engine.step():
            first = first or next(e.choices[0] for e in events if e.type == "delta")
    scored = first.prompt_logprobs
    assert len(scored) == len(ids) and scored[0].logprob is None
    with torch.no_grad():
        expected = lm.model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position in (1, 20, len(ids) - 1):  # the logprob of token p given tokens before it
        assert scored[position].logprob == pytest.approx(
            float(expected[position - 1, ids[position]]), abs=1e-4
        )
        assert len(scored[position].top_logprobs) == 2
