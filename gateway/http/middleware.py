"""The gateway's ASGI middleware for what every request carries (pure ASGI, so streamed responses
pass through untouched): headers kept in context variables for the request's log lines and jobs
(`x-request-id`, echoed back; `x-cortex-session`, for routing), and the request's trace span.
The body limits are gateway/http/body_limit.py and gateway/http/json_body.py."""

import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar

from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.tracing import HEADER as TRACE_HEADER
from gateway.tracing import SCOPE, TRACED_PREFIX, request_id_var, trace_id_var
from shared import tracing

REQUEST_ID_HEADER = b"x-request-id"
SESSION_HEADER = b"x-cortex-session"
_ACCEPTABLE_ID = re.compile(rb"^[\w.:@/+=-]{1,128}$")  # a request id echoed back unchanged
_CONTEXT_HEADERS = (b"traceparent", b"tracestate")


def request_id(given: bytes) -> str:
    """The client's own request id where it is a sensible one, else a new one."""
    return given.decode() if _ACCEPTABLE_ID.match(given) else uuid.uuid4().hex


def session(given: bytes) -> str:
    return given.decode("utf-8", "replace")[:256]


class HeaderVarMiddleware:
    """Keeps one request header, as `value` makes it, in `var` while the request runs; with `echo`,
    the value goes back on the response under the same header."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        header: bytes,
        var: ContextVar[str],
        value: Callable[[bytes], str],
        echo: bool = False,
    ):
        self.app, self.header, self.var, self.value, self.echo = app, header, var, value, echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = self.value(dict(scope["headers"]).get(self.header, b""))
        token = self.var.set(value)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (self.header, value.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_header if self.echo else send)
        finally:
            self.var.reset(token)


class TracingMiddleware:
    """Pure ASGI, so streaming responses pass through untouched; the span ends with the response's last byte."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = tracing.tracer(SCOPE)
        if tracer is None or scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            return await self.app(scope, receive, send)
        method = scope["method"]
        parent = tracing.parent_context(
            {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _CONTEXT_HEADERS}
        )
        attributes = {
            "http.request.method": method,
            "url.path": scope["path"],
            "cortex.request_id": request_id_var.get(),
        }
        with tracer.start_as_current_span(
            f"{method} {scope['path']}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            trace_id = tracing.trace_id(span)
            token = trace_id_var.set(trace_id)

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [
                        *message.get("headers", []),
                        (TRACE_HEADER, trace_id.encode()),
                    ]
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(StatusCode.ERROR)
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                trace_id_var.reset(token)
                route = getattr(
                    scope.get("route"), "path", None
                )  # the matched route's template, once routed
                span.update_name(f"{method} {route}" if route else method)
