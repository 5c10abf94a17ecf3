"""A newcomer's row (fair shares, node_agent/engine/scheduler.Share): with every row taken, a job
whose caller had no job on the replica preempts the newest sequence of the caller holding the most
rows and reads its prompt at the next step; the preempted sequence waits right after it, resumes,
and finishes with the tokens it would have had alone. Where no caller holds more than one row, or
the job is no newcomer, it waits its turn."""

import pytest

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


@pytest.mark.parametrize(
    "running, arriving",
    [
        (("alice", "bob"), Share("carol", newcomer=True)),  # one row each: nobody's to take
        (("flood", "flood"), Share("bystander")),  # no newcomer
    ],
)
def test_a_job_waits_its_turn_without_a_larger_share_or_as_no_newcomer(
    tiny_llama, running, arriving
):
    """A newcomer waits ahead of the jobs already waiting, but takes no row where no caller holds
    more than one; a job that came as no newcomer waits behind them and preempts nobody."""
    engine = two_rows(tiny_llama)
    for job, tenant in zip(("a", "b"), running):
        add(engine, chat(job, "Hello there"), Share(tenant))
    engine.step()
    add(engine, chat("d", "Say something kind."), Share("dave"))
    add(engine, chat("c", "Count to five."), arriving)
    engine.step()
    assert rows_of(engine) == ["a", "b"] and engine.kv_stats().preemptions == 0
    waiting = [s.job.id for s in engine.scheduler.waiting]
    assert waiting == (["c", "d"] if arriving.newcomer else ["d", "c"])
    while engine.has_work:
        engine.step()
    assert engine.pool.used == 0
