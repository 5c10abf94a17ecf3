"""A newcomer's row (fair shares, node_agent/engine/scheduler.Share): with every row taken, a job
whose caller had no job on the replica preempts the newest sequence of the caller holding the most
rows and reads its prompt at the next step; the preempted sequence waits right after it, resumes,
and finishes with the tokens it would have had alone. Where no caller holds more than one row, or
the job is no newcomer, it waits its turn."""

from node_agent.engine.engine import Engine, check_fits
from node_agent.engine.scheduler import Share
from node_agent.serving import prompts
from tests.unit.node_agent.engine_driver import Result, collect, request, run


def chat(job: str, content: str):
    return request(job, content, temperature=0, ignore_eos=True, max_tokens=10)


def add(engine: Engine, req, share: Share) -> None:
    ids = prompts.prompt_ids(engine.lm.tokenizer, engine.profile, req)
    check_fits(engine.max_len, len(ids), req.sampling.max_tokens)
    engine.add(req, ids, 0.0, None, share)


def rows_of(engine: Engine) -> list[str]:
    return sorted(s.job.id for s in engine.scheduler.rows)


def two_rows(tiny_llama) -> Engine:
    profile, lm = tiny_llama
    return Engine(lm, profile.model_copy(update={"slots": 2}))


def step(engine: Engine, results: dict[str, Result]) -> None:
    for job, events in engine.step():
        collect(results.setdefault(job, Result()), events)


def test_a_newcomer_takes_a_row_from_the_largest_share_at_its_next_step(tiny_llama):
    profile, lm = tiny_llama
    reqs = [chat("f1", "Hello there"), chat("f2", "Why?"), chat("b", "Count to five.")]
    alone = {r.job: run(Engine(lm, profile), r)[r.job].token_ids for r in reqs}
    engine, results = two_rows(tiny_llama), {}
    for req in reqs[:2]:
        add(engine, req, Share("flood"))
    for _ in range(3):  # both flood jobs decoding
        step(engine, results)
    assert rows_of(engine) == ["f1", "f2"]
    add(engine, reqs[2], Share("bystander", newcomer=True))
    step(engine, results)
    assert rows_of(engine) == ["b", "f1"]  # f2, the flood's newest, gave its row
    assert [s.job.id for s in engine.scheduler.waiting] == ["f2"]
    assert engine.kv_stats().preemptions == 1
    while engine.has_work:
        step(engine, results)
    assert {job: r.token_ids for job, r in results.items()} == alone
    assert engine.pool.used == 0


def test_without_a_larger_share_a_newcomer_waits_its_turn(tiny_llama):
    engine = two_rows(tiny_llama)
    add(engine, chat("a", "Hello there"), Share("alice"))
    add(engine, chat("b", "Why?"), Share("bob"))
    engine.step()
    add(engine, chat("c", "Count to five."), Share("carol", newcomer=True))
    add(engine, chat("d", "Say something kind."), Share("dave"))
    engine.step()
    assert rows_of(engine) == ["a", "b"]  # one row each: nobody's to take
    assert [s.job.id for s in engine.scheduler.waiting] == ["c", "d"]  # the newcomer first
    assert engine.kv_stats().preemptions == 0
    while engine.has_work:
        engine.step()
    assert engine.pool.used == 0


def test_a_job_that_is_no_newcomer_never_preempts(tiny_llama):
    engine = two_rows(tiny_llama)
    add(engine, chat("f1", "Hello there"), Share("flood"))
    add(engine, chat("f2", "Why?"), Share("flood"))
    engine.step()
    add(engine, chat("b", "Count to five."), Share("bystander"))
    engine.step()
    assert rows_of(engine) == ["f1", "f2"] and engine.kv_stats().preemptions == 0
