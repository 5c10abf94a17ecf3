"""Rendering edge cases not covered through the routes."""

from gateway.dialects.render.chat import chat_chunks
from gateway.dialects.render.completions import completion_chunks, legacy_logprobs
from shared.wire import TokenLogprob
from tests.unit.gateway.conftest import delta, done


class JobInfo:
    id, created, model, prompt_tokens, prompt_text = "j", 1, "M", 0, None


async def events(*items):
    for item in items:
        yield item


async def test_choice_without_finish_reason_is_finished_at_done():
    chunks = [
        c
        async for c in chat_chunks(JobInfo(), events(delta("a"), done()), n=1, include_usage=False)
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"
    chunks = [
        c
        async for c in completion_chunks(
            JobInfo(), events(delta("a"), done()), n=1, include_usage=False
        )
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_empty_deltas_are_not_sent():
    chunks = [
        c
        async for c in chat_chunks(
            JobInfo(),
            events(delta(""), delta("", finish_reason="stop"), done()),
            n=1,
            include_usage=False,
        )
    ]
    assert [c.choices[0].model_dump()["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {},
    ]


def test_legacy_logprobs_offsets():
    tokens = [TokenLogprob(token=t, logprob=-1.0, bytes=[]) for t in ("ab", "c", "def")]
    assert legacy_logprobs(tokens, offset=10).text_offset == [10, 12, 13]
    assert legacy_logprobs(None) is None
