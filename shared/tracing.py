"""OpenTelemetry traces: one trace per API request, from the gateway's admission to the node's decode.

Off unless `CORTEX_OTLP_ENDPOINT` names a collector's OTLP/HTTP endpoint (e.g.
`http://otel-collector:4318`; spans go to its `/v1/traces`). Each process exports its own spans, as
service `cortex-gateway` or `cortex-node`; they join one trace because the job carries the trace
context of the gateway's request span: its W3C `traceparent`, a field of the job's stream entry
(shared/wire.py). The usual `OTEL_*` variables apply (`OTEL_TRACES_SAMPLER`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_EXPORTER_OTLP_HEADERS`, ...).

While tracing is off, `tracer()` is None and callers do no tracing work at all."""

import logging

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, below a collector's base URL

_provider: trace.TracerProvider | None = None
_tracers: dict[str, trace.Tracer] = {}
_propagator = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` itself if it names the traces path, else that path below it."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def configure(service: str, endpoint: str, instance: str = "") -> trace.TracerProvider | None:
    """Export this process's spans over OTLP/HTTP to `endpoint`, as `service`; '' leaves tracing off.
    Returns the provider it installed (it flushes at exit, or on `force_flush`)."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {"service.name": service} | ({"service.instance.id": instance} if instance else {})
    )
    provider = TracerProvider(
        resource=resource
    )  # its sampler follows OTEL_TRACES_SAMPLER; it flushes at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    install(provider)
    log.info("tracing: %s sends spans to %s", service, traces_url(endpoint))
    return provider


def install(provider: trace.TracerProvider | None) -> None:
    """Trace through `provider` from now on (None: stop tracing). Tests install one with an in-memory exporter."""
    global _provider
    _provider = provider
    _tracers.clear()


def tracer(scope: str) -> trace.Tracer | None:
    """The tracer of `scope` (`cortex.gateway`, `cortex.node`), or None while tracing is off."""
    if _provider is None:
        return None
    if (found := _tracers.get(scope)) is None:
        found = _tracers[scope] = _provider.get_tracer(scope)
    return found


def traceparent(span: trace.Span) -> str | None:
    """`span`'s W3C trace context, to carry to another process; None for a span that is not real."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def parent_context(headers: dict[str, str]) -> Context:
    """The context a `traceparent` (in `headers`, lower-case names) continues; empty when absent or malformed."""
    return _propagator.extract(headers)


def trace_id(span: trace.Span) -> str:
    """`span`'s trace id in hex, as trace viewers show it; '' for a span that is not real."""
    context = span.get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else ""
