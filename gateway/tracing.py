"""The gateway's spans of a request's trace (shared/tracing.py; nothing here works while tracing is off).

`TracingMiddleware` (gateway/http/middleware.py) opens one span per API request (`/v1/...`), continuing the client's own trace
when it sends a `traceparent`, names the trace in the response's `x-trace-id` header and in every
log line the request causes (`TraceLogFormatter`). Inside it, `span()` times one part of the request
(admission, placement) and a job's `JobTrace` times its wait in the queue (enqueued until a node's
first event) and carries the request span's context to the node, whose tokenisation, prefill and
decode spans are its children (node_agent/serving/job_spans.py)."""

import logging
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar

from opentelemetry import trace

from shared import tracing
from shared.wire import DoneEvent

SCOPE = "cortex.gateway"
HEADER = b"x-trace-id"
TRACED_PREFIX = (
    "/v1/"  # the API; health checks, metrics scrapes and the dashboard's polling are not traced
)
_CONTEXT_HEADERS = (b"traceparent", b"tracestate")

trace_id_var: ContextVar[str] = ContextVar("trace_id", default="")
request_id_var: ContextVar[str] = ContextVar(
    "request_id", default="-"
)  # x-request-id (gateway/http/middleware.py)


def span(name: str) -> AbstractContextManager:
    """A child span of the current one around a part of the request; nothing while tracing is off."""
    tracer = tracing.tracer(SCOPE)
    return nullcontext() if tracer is None else tracer.start_as_current_span(name)


class JobTrace:
    """A job's part of its request's trace, made where it is submitted: its wait in the queue, and on
    the request's span what the job was and how it ended."""

    def __init__(self, job: str, model: str):
        tracer = tracing.tracer(SCOPE)
        self.request = trace.get_current_span() if tracer is not None else trace.INVALID_SPAN
        self.waiting: trace.Span | None = None
        if self.request.is_recording():
            self.request.set_attributes({"cortex.job": job, "cortex.model": model})
            self.waiting = tracer.start_span("queue wait")

    @property
    def traceparent(self) -> str | None:
        """What the job carries to its node (shared/wire.StreamEntry.traceparent)."""
        return tracing.traceparent(self.request) if self.request.is_recording() else None

    def queued(self, stream: str, entry_id: str) -> None:
        if self.waiting is not None:
            self.waiting.set_attributes({"cortex.stream": stream, "cortex.entry_id": entry_id})

    def taken(self) -> None:
        """The job's first event came (a node took it) or its wait ended otherwise."""
        if self.waiting is not None:
            self.waiting.end()
            self.waiting = None

    def done(self, event: DoneEvent) -> None:
        if self.request.is_recording():
            self.request.set_attributes(
                {
                    "cortex.node": event.node,
                    "gen_ai.usage.input_tokens": event.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": event.usage.completion_tokens,
                }
            )

    def failed(self, code: str) -> None:
        if self.request.is_recording():
            self.request.set_attribute("cortex.error", code)


class TraceLogFormatter(logging.Formatter):
    """Lines logged while a traced request runs end with its trace id (` trace=...`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        trace_id = trace_id_var.get()
        return f"{line} trace={trace_id}" if trace_id else line
