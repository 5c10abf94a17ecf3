"""Job events on the wire: one typed definition each, built by the node, decoded by the gateway."""

import msgpack
import numpy as np
import pytest

from shared import WIRE_VERSION
from shared.wire import (
    ChoiceDelta,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    Pooled,
    PoolingRequest,
    PromptLogprob,
    StartEvent,
    StreamEntry,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    WireError,
    ends_job,
    joined_deltas,
    pack,
    pack_event,
    unpack,
    unpack_event,
)

TOP = TopLogprob(token=" Paris", logprob=-0.25, bytes=list(b" Paris"))
DELTA = DeltaEvent(
    choices=[
        ChoiceDelta(
            index=0,
            text=" Paris",
            token_ids=[7042],
            logprobs=[
                TokenLogprob(
                    token=" Paris", logprob=-0.25, bytes=list(b" Paris"), top_logprobs=[TOP]
                )
            ],
            prompt_logprobs=[
                PromptLogprob(token="The", logprob=None),
                PromptLogprob(token=" capital", logprob=-3.5, top_logprobs=[TOP]),
            ],
        ),
        ChoiceDelta(index=1, text="", token_ids=[2], finish_reason="stop", stop_sequence="\n"),
    ]
)
EVENTS = [
    StartEvent(prompt_tokens=9, prompt_text="<s>The capital"),
    DELTA,
    DoneEvent(
        usage=Usage(prompt_tokens=9, completion_tokens=2),
        timings=Timings(queue_ms=1.5, prefill_ms=20.0, decode_ms=31.25),
        node="n1",
    ),
    ErrorEvent(code="node_lost", message="node n1 went away"),
    DoneEvent(
        usage=Usage(prompt_tokens=5),
        node="n1",
        pooled=Pooled(vectors=[np.arange(4, dtype="<f4").tobytes()], forwards=1),
    ),
    DoneEvent(usage=Usage(prompt_tokens=5), pooled=Pooled(scores=[0.25, -1.5], forwards=2)),
]


def _raw(**event) -> bytes:
    """An event as some other writer might send it."""
    return msgpack.packb({"v": WIRE_VERSION} | event)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_each_event_round_trips(event):
    got = unpack_event(pack_event(event))
    assert type(got) is type(event) and got == event and got.v == WIRE_VERSION


def test_the_wire_shape_is_a_readable_map_tagged_by_type():
    assert msgpack.unpackb(pack_event(ErrorEvent(code="c", message="m"))) == {
        "type": "error",
        "v": WIRE_VERSION,
        "code": "c",
        "message": "m",
    }
    # an event carries all its fields; its parts leave out those at their defaults
    assert msgpack.unpackb(pack_event(DoneEvent(usage=Usage(prompt_tokens=3)))) == {
        "type": "done",
        "v": WIRE_VERSION,
        "usage": {"prompt_tokens": 3},
        "timings": {},
        "node": "",
        "pooled": None,
    }
    assert msgpack.unpackb(
        pack_event(DeltaEvent(choices=[ChoiceDelta(text="a", token_ids=[5])]))
    ) == {"type": "delta", "v": WIRE_VERSION, "choices": [{"text": "a", "token_ids": [5]}]}
    assert unpack_event(pack_event(DoneEvent(usage=Usage(prompt_tokens=3)))).usage == Usage(
        prompt_tokens=3
    )
    assert DoneEvent(usage=Usage(prompt_tokens=3, completion_tokens=4)).usage.total_tokens == 7


@pytest.mark.parametrize(
    "build",
    [
        lambda: DeltaEvent(choice=[]),
        lambda: ChoiceDelta(index=0, txt="a"),
        lambda: TokenLogprob(token="a", logprob=-1.0, bytes=[97], top_logprob=[]),
        lambda: TopLogprob(token="a", logprob=-1.0, byte=[97]),
        lambda: PromptLogprob(token="a", logprob=None, bytes=[97]),
        lambda: DoneEvent(usage=Usage(), timing=Timings()),
        lambda: Usage(prompt_token=1),
        lambda: Timings(queue=1.0),
        lambda: StartEvent(prompt_tokens=1, prompt="x"),
        lambda: ErrorEvent(code="c", msg="m"),
        lambda: ErrorEvent(code="c", message="m", type="done"),
        lambda: StartEvent(),  # a required field left out
        lambda: ChoiceDelta(0, "a"),  # by keyword only: no field is filled by position
    ],
    ids=range(13),
)
def test_a_misspelt_field_cannot_be_built_on_the_node(build):
    with pytest.raises(TypeError):
        build()


@pytest.mark.parametrize(
    "raw, where",
    [
        (_raw(type="delta", choices=[], extra=1), "unknown field `extra`"),
        (
            _raw(type="delta", choices=[{"index": 0, "txt": "a"}]),
            "unknown field `txt` - at `$.choices[0]`",
        ),
        (
            _raw(
                type="delta",
                choices=[{"logprobs": [{"token": "a", "logprob": -1.0, "bytes": [], "top": []}]}],
            ),
            "unknown field `top` - at `$.choices[0].logprobs[0]`",
        ),
        (
            _raw(type="done", usage={"prompt_tokens": 1, "total": 2}),
            "unknown field `total` - at `$.usage`",
        ),
        (
            _raw(type="done", usage={}, timings={"queue": 1.0}),
            "unknown field `queue` - at `$.timings`",
        ),
        (
            _raw(type="delta", choices=[{"token_ids": ["a"]}]),
            "Expected `int`, got `str` - at `$.choices[0].token_ids[0]`",
        ),
        (_raw(type="start"), "missing required field `prompt_tokens`"),
        (_raw(type="finished"), "Invalid value 'finished' - at `$.type`"),
        (_raw(choices=[]), "missing required field `type`"),
        (msgpack.packb(["delta"]), "Expected `object`, got `array`"),
        (b"\xc1", "MessagePack data is malformed"),
    ],
    ids=range(11),
)
def test_a_bad_or_unknown_field_is_refused_on_decode(raw, where):
    with pytest.raises(WireError, match="^bad event: ") as refused:
        unpack_event(raw)
    assert where in str(refused.value)


@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb({"v": 99, "type": "delta", "choices": []}),
        msgpack.packb(
            {"v": 99, "type": "delta", "choices": [], "chunks": []}
        ),  # another version's shape: its version told
        msgpack.packb({"v": 99, "type": "progress"}),
        msgpack.packb({"type": "done", "usage": {}, "shape": "new"}),
    ],
    ids=["same shape", "new field", "new type", "no version"],
)
def test_another_wire_version_is_refused_by_its_version(raw):
    got = msgpack.unpackb(raw).get("v")
    with pytest.raises(
        WireError, match=rf"^wire version {got!r} is not {WIRE_VERSION}; upgrade the older part$"
    ):
        unpack_event(raw)


def test_done_and_error_end_a_job():
    assert ends_job([DELTA, EVENTS[2]]) and ends_job([EVENTS[3]])
    assert not ends_job([EVENTS[0]]) and not ends_job([DELTA])


def test_a_pooling_job_travels_as_its_own_request():
    request = PoolingRequest(
        job="j", model="m", kind="embed", inputs=["a text", [101, 7, 102]], dimensions=8
    )
    entry = StreamEntry(
        job="j", kind="embed", model="m", submitted_ms=1, channel="r", body=pack(request)
    )
    fields = {
        k.encode(): v if isinstance(v, bytes) else str(v).encode()
        for k, v in entry.to_fields().items()
    }
    assert StreamEntry.from_fields(fields).pooling_request() == request
    with pytest.raises(WireError, match="bad GenerationRequest"):  # a generation node refuses it
        StreamEntry.from_fields(fields).request()


def test_a_cache_salt_travels_only_when_set():
    """Added within wire version 7: a job without one packs as before (a node of 7 that predates it
    reads it); one with it reaches the node, and such an older node refuses it rather than ignore it."""
    plain = GenerationRequest(job="j", model="m", kind="chat", messages=[])
    assert "cache_salt" not in msgpack.unpackb(pack(plain))
    salted = plain.model_copy(update={"cache_salt": "ab12"})
    assert unpack(pack(salted), GenerationRequest).cache_salt == "ab12"
    assert unpack(pack(plain), GenerationRequest).cache_salt == ""


def test_joined_deltas_keep_each_choices_tokens_in_order_and_its_end():
    def lp(token: str) -> TokenLogprob:
        return TokenLogprob(token=token, logprob=-1.0, bytes=list(token.encode()))

    events = [
        DeltaEvent(
            choices=[
                ChoiceDelta(index=0, text="He", token_ids=[1], logprobs=[lp("He")]),
                ChoiceDelta(index=1, text="Bo", token_ids=[7]),
            ]
        ),
        DeltaEvent(choices=[ChoiceDelta(index=1, text="nj", token_ids=[8], finish_reason="stop")]),
        DeltaEvent(choices=[ChoiceDelta(index=0, text="llo", token_ids=[2], logprobs=[lp("llo")])]),
        DoneEvent(usage=Usage(prompt_tokens=3, completion_tokens=4)),
    ]
    joined, done = joined_deltas(events)
    assert done is events[-1]
    zero, one = joined.choices
    assert (zero.index, zero.text, zero.token_ids) == (0, "Hello", [1, 2])
    assert [p.token for p in zero.logprobs] == ["He", "llo"] and zero.finish_reason is None
    assert (one.index, one.text, one.token_ids, one.finish_reason) == (1, "Bonj", [7, 8], "stop")
    assert one.logprobs is None
    assert events[0].choices[0].text == "He"  # the events given are left as they were
