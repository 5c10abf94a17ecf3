"""Job events and fleet state → Ollama objects, without I/O: chunks, the folded whole, tool calls,
logprobs, metrics, `/api/ps` expiry."""

from gateway.dialects.render.ollama import chat_chunks, generate_chunks, whole_chat, whole_generate
from gateway.dialects.render.ollama_models import running
from gateway.dialects.tools.parsers import make_parser
from gateway.dialects.tools.thinking import ThinkingSplitter
from shared.catalog import ModelProfile
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.lifecycle import ModelState
from shared.wire import DoneEvent, Timings, TokenLogprob, TopLogprob, Usage
from tests.unit.gateway.conftest import delta
from tests.unit.gateway.dialects.render.test_render import JobInfo, events

DONE = DoneEvent(
    usage=Usage(prompt_tokens=4, completion_tokens=2),
    timings=Timings(queue_ms=1, prefill_ms=2, decode_ms=3),
)


async def test_text_streams_then_a_final_object_with_metrics():
    chunks = [
        c
        async for c in chat_chunks(
            JobInfo(),
            events(delta("a"), delta(""), delta("b", finish_reason="stop"), DONE),
            "m:latest",
            None,
        )
    ]
    assert [(c.message.content, c.done) for c in chunks] == [
        ("a", False),
        ("b", False),
        ("", True),
    ]  # no empty step
    final = chunks[-1]
    assert (final.model, final.done_reason, final.prompt_eval_count, final.eval_count) == (
        "m:latest",
        "stop",
        4,
        2,
    )
    assert (
        final.load_duration,
        final.prompt_eval_duration,
        final.eval_duration,
        final.total_duration,
    ) == (1_000_000, 2_000_000, 3_000_000, 6_000_000)
    assert final.created_at.timestamp() == JobInfo.created


async def test_the_whole_answer_is_the_stream_folded():
    steps = (delta("Hel"), delta("lo", finish_reason="length"), DONE)
    whole = await whole_generate(generate_chunks(JobInfo(), events(*steps), "m"))
    assert (whole.response, whole.done, whole.done_reason, whole.eval_count) == (
        "Hello",
        True,
        "length",
        2,
    )


async def test_two_calls_each_go_out_whole_once_complete():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"y": [2]}}</tool_call>'
    )
    steps = [
        delta(text[:30]),
        delta(text[30:100]),
        delta(text[100:], finish_reason="stop"),
        DONE,
    ]  # b starts in the 2nd
    chunks = [
        c async for c in chat_chunks(JobInfo(), events(*steps), "m", make_parser("hermes", "job"))
    ]
    calls = [(c.message.tool_calls or []) for c in chunks]
    assert [
        [(t.function.index, t.function.name, t.function.arguments) for t in made]
        for made in calls
        if made
    ] == [[(0, "a", {"x": 1})], [(1, "b", {"y": [2]})]]
    whole = await whole_chat(
        chat_chunks(JobInfo(), events(*steps), "m", make_parser("hermes", "job"))
    )
    assert [t.function.name for t in whole.message.tool_calls] == [
        "a",
        "b",
    ] and whole.message.content == ""
    assert whole.done_reason == "stop"


async def test_a_cut_off_call_is_not_content():
    steps = [delta('<tool_call>{"name": "a", "argu', finish_reason="length"), DONE]
    whole = await whole_chat(
        chat_chunks(JobInfo(), events(*steps), "m", make_parser("hermes", "job"))
    )
    assert whole.message.content == "" and whole.done_reason == "length"


async def test_logprobs_come_with_their_tokens():
    token = TokenLogprob(
        token="a",
        logprob=-0.5,
        bytes=[97],
        top_logprobs=[TopLogprob(token="b", logprob=-1.0, bytes=[98])],
    )
    whole = await whole_chat(
        chat_chunks(JobInfo(), events(delta("a", logprobs=[token]), DONE), "m", None)
    )
    assert [p.model_dump(exclude_none=True) for p in whole.logprobs] == [
        {
            "token": "a",
            "logprob": -0.5,
            "bytes": [97],
            "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": [98]}],
        }
    ]


def test_ps_expiry_is_the_later_of_the_catalogues_keep_alive_and_a_requests():
    profile = ModelProfile(id="m", source="/m.gguf", keep_alive_s=300)
    info = ModelInfo(state=ModelState.READY, device="cuda:0", memory_mb=2, last_used_ms=1_000_000)
    nodes = [
        NodeHeartbeat(node="n1", version="t", started_ms=0, heartbeat_ms=0, models={"m": info})
    ]
    [model] = running([profile], nodes, pinned=set()).models
    assert model.expires_at.timestamp() == 1_300  # 300 s after its last job
    assert (model.name, model.size, model.size_vram, model.nodes) == (
        "m:latest",
        2 * 1024 * 1024,
        2 * 1024 * 1024,
        ["n1"],
    )
    info.keep_until_ms = 5_000_000  # a request asked for longer
    assert running([profile], nodes, pinned=set()).models[0].expires_at.timestamp() == 5_000
    assert running([profile], nodes, pinned={"m"}).models[0].expires_at.year == 9999
    info.state = ModelState.LOADING
    assert running([profile], nodes, pinned=set()).models == []  # only ready replicas are running


async def test_thinking_goes_out_apart_from_the_content_and_the_calls():
    steps = [
        delta("<think>I should call a."),
        delta("</think>\n\n<tool_call>"),
        delta('{"name": "a", "arguments": {}}</tool_call>', finish_reason="stop"),
        DONE,
    ]
    whole = await whole_chat(
        chat_chunks(
            JobInfo(), events(*steps), "m", make_parser("hermes", "job"), ThinkingSplitter()
        )
    )
    assert (whole.message.thinking, whole.message.content) == ("I should call a.", "")
    assert [call.function.name for call in whole.message.tool_calls] == ["a"]
    generated = await whole_generate(
        generate_chunks(
            JobInfo(),
            events(delta("<think>x</think>y", finish_reason="stop"), DONE),
            "m",
            ThinkingSplitter(),
        )
    )
    assert (generated.thinking, generated.response) == ("x", "y")
    unasked = await whole_generate(
        generate_chunks(JobInfo(), events(delta("<think>x</think>y"), DONE), "m")
    )
    assert (unasked.thinking, unasked.response) == (None, "<think>x</think>y")
