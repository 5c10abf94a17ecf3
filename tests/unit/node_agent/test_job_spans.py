"""A job's spans on the node (node_agent/serving/job_spans.py), made when it ends: under the request's
span its traceparent names, `tokenize` from the node's own times, `prefill` and `decode` from the done
event's timings ending when the job does; a failed job's span says its error; an untraced job, or a node
that does not trace, makes none."""

import time

import pytest
from opentelemetry.trace import StatusCode

from node_agent.serving.job_spans import JobSpans
from shared import tracing
from shared.wire import StreamEntry, Timings, WireError

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def entry(traceparent: str | None = f"00-{TRACE}-{PARENT}-01") -> StreamEntry:
    return StreamEntry(
        job="j1",
        kind="chat",
        model="m",
        submitted_ms=0,
        channel="r",
        body=b"",
        traceparent=traceparent,
    )


def test_a_finished_job_spans_tokenize_prefill_and_decode(spans):
    job_spans = JobSpans.of(entry(), "1-0", "n1")
    start = time.time_ns()
    job_spans.tokenized_ns = (start, start + 2_000_000)
    job_spans.end(Timings(queue_ms=3.0, prefill_ms=5.0, decode_ms=7.0))

    named = {span.name: span for span in spans.get_finished_spans()}
    assert set(named) == {"node job", "tokenize", "prefill", "decode"}
    job = named["node job"]
    assert (f"{job.context.trace_id:032x}", f"{job.parent.span_id:016x}") == (TRACE, PARENT)
    assert all(
        named[name].parent.span_id == job.context.span_id
        for name in ("tokenize", "prefill", "decode")
    )
    assert dict(job.attributes) == {
        "cortex.job": "j1",
        "cortex.model": "m",
        "cortex.node": "n1",
        "cortex.entry_id": "1-0",
    }
    assert (named["tokenize"].start_time, named["tokenize"].end_time) == job_spans.tokenized_ns
    prefill, decode = named["prefill"], named["decode"]
    assert decode.end_time == job.end_time and decode.end_time - decode.start_time == 7_000_000
    assert (
        prefill.end_time == decode.start_time and prefill.end_time - prefill.start_time == 5_000_000
    )
    assert job.start_time == job_spans.read_ns and job.status.status_code == StatusCode.UNSET


def test_a_failed_job_says_its_error(spans):
    job_spans = JobSpans.of(entry(), "1-0", "n1")
    job_spans.error = "context_length_exceeded"
    job_spans.end(None)
    [job] = spans.get_finished_spans()  # it never tokenised nor ran
    assert job.name == "node job" and job.status.status_code == StatusCode.ERROR
    assert job.attributes["cortex.error"] == "context_length_exceeded"


def test_no_trace_without_a_traceparent_or_tracing(spans):
    assert JobSpans.of(entry(None), "1-0", "n1") is None
    tracing.install(None)
    assert JobSpans.of(entry(), "1-0", "n1") is None


def test_a_malformed_traceparent_is_refused_with_the_entry():
    fields = {
        k.encode(): v if isinstance(v, bytes) else str(v).encode()
        for k, v in entry().to_fields().items()
    }
    with pytest.raises(WireError, match="traceparent"):
        StreamEntry.from_fields(fields | {b"traceparent": b"00-nothex-01"})
