"""Tracing with OpenTelemetry, configured by its standard environment variables, and the trace context carried
across NATS in W3C `traceparent` headers: on commands, on the events they cause, on a task's stored request.

`OTEL_TRACES_EXPORTER` names the exporters (`otlp`, over HTTP/protobuf; `console`; `none`; a comma-separated
list); unset, an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) means
`otlp`, and neither means tracing is off: no provider, no exporter, and every helper here returns at once. The
SDK reads the rest itself: `OTEL_SERVICE_NAME` (default `jetshard-<service>`), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`, the exporter's endpoint, headers and timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Span, SpanKind

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

tracer = trace.get_tracer("jetshard")
EXPORTERS = ("otlp", "console")
FLUSH_TIMEOUT_S = 1.0
"""How long a stopping service waits for its last spans to leave: an unreachable collector must not hold it past
its shutdown deadline."""

_provider: TracerProvider | None = None
"""Set only while tracing is on; without it every span would be a no-op, and skipping them keeps hot paths lean."""
_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters `environ` asks for, in order; none when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not named:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = []
    for name in (n.strip() for n in named.split(",")):
        if name in EXPORTERS and name not in names:
            names.append(name)
        elif name not in ("", "none"):
            log.warning("OTEL_TRACES_EXPORTER names %r, which jetshard lacks; it has %s", name, ", ".join(EXPORTERS))
    return names


def _exporter(name: str) -> SpanExporter:
    # Imported only when asked for: the OTLP exporter brings protobuf and requests.
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def configure_tracing(service: str, environ: Mapping[str, str] = os.environ) -> None:
    """Install a tracer provider exporting as `environ` says, or nothing when it asks for no exporter.
    `service` may name a part (`runner/0`): the service is what precedes the slash."""
    global _provider
    names = exporter_names(environ)
    if not names:
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    default_name = f"jetshard-{service.partition('/')[0]}"
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME, default_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: named}), shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing() -> None:
    """Export the spans still buffered, waiting at most FLUSH_TIMEOUT_S."""
    if _provider is None:
        return
    flushing = threading.Thread(target=_provider.shutdown, name="span-flush", daemon=True)
    flushing.start()
    flushing.join(FLUSH_TIMEOUT_S)


def enabled() -> bool:
    return _provider is not None


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (if any) to outgoing NATS headers."""
    if _provider is not None:
        propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> context.Context:
    """The trace context that arrived in `headers` (an empty one without)."""
    return propagate.extract(dict(headers or {}))


def continued(headers: Mapping[str, str] | None) -> AbstractContextManager[None]:
    """Make the trace context that arrived in `headers` current: what runs inside continues that trace."""
    return _OFF if _provider is None else _attached(headers)


def span(name: str, kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
    """A span in the current context, made current; None (set no attributes) when tracing is off."""
    return _OFF if _provider is None else tracer.start_as_current_span(name, kind=kind)


def span_from(
    headers: Mapping[str, str] | None, name: str, kind: SpanKind = SpanKind.CONSUMER
) -> AbstractContextManager[Span | None]:
    """A span continuing the trace whose context arrived in `headers`; None when tracing is off."""
    return _OFF if _provider is None else _continued_span(headers, name, kind)


@contextlib.contextmanager
def _attached(headers: Mapping[str, str] | None) -> Iterator[None]:
    token = context.attach(extract(headers))
    try:
        yield
    finally:
        context.detach(token)


@contextlib.contextmanager
def _continued_span(headers: Mapping[str, str] | None, name: str, kind: SpanKind) -> Iterator[Span]:
    with _attached(headers), tracer.start_as_current_span(name, kind=kind) as current:
        yield current
