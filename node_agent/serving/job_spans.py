"""A job's spans on the node, in the trace of the request that made it (shared/tracing.py).

The job carries its request span's context (`StreamEntry.traceparent`). The node's spans are made
when the job ends, from times it measures anyway: when it read the job, its tokenisation, and the
done event's timings (prefill: admitted to the first token; decode: first token to done), so the
engine's loop and the per-token path do no tracing work. Spans: `node job` (read to end), a child
of the gateway's request span, with `tokenize`, `prefill` and `decode` inside it."""

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode

from shared import tracing
from shared.wire import StreamEntry, Timings

SCOPE = "cortex.node"


@dataclass
class JobSpans:
    parent: Context
    attributes: dict[str, str]
    read_ns: int
    tokenized_ns: tuple[int, int] | None = (
        None  # (start, end) of rendering and tokenising its prompt
    )
    error: str = ""  # the error code it failed with

    @classmethod
    def of(cls, entry: StreamEntry, entry_id: str, node: str) -> "JobSpans | None":
        """The trace of a job just read, if its request is traced and tracing is on here."""
        if entry.traceparent is None or tracing.tracer(SCOPE) is None:
            return None
        attributes = {
            "cortex.job": entry.job,
            "cortex.model": entry.model,
            "cortex.node": node,
            "cortex.entry_id": entry_id,
        }
        return cls(
            tracing.parent_context({"traceparent": entry.traceparent}), attributes, time.time_ns()
        )

    def end(self, timings: Timings | None) -> None:
        """Make the job's spans, ending now: with the done event's `timings`, or None when it failed."""
        tracer = tracing.tracer(SCOPE)
        if tracer is None:
            return
        end_ns = time.time_ns()
        job = tracer.start_span(
            "node job", self.parent, SpanKind.CONSUMER, self.attributes, start_time=self.read_ns
        )
        inside = trace.set_span_in_context(job)
        if self.tokenized_ns is not None:
            tracer.start_span("tokenize", inside, start_time=self.tokenized_ns[0]).end(
                self.tokenized_ns[1]
            )
        if timings is not None:
            first_token_ns = end_ns - int(timings.decode_ms * 1e6)
            admitted_ns = first_token_ns - int(timings.prefill_ms * 1e6)
            tracer.start_span("prefill", inside, start_time=admitted_ns).end(first_token_ns)
            tracer.start_span("decode", inside, start_time=first_token_ns).end(end_ns)
        if self.error:
            job.set_attribute("cortex.error", self.error)
            job.set_status(StatusCode.ERROR, self.error)
        job.end(end_ns)
