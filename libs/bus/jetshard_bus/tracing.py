"""Trace context across NATS: W3C `traceparent` headers on commands and the events they cause.

Tracing is off unless `JETSHARD_TRACE=console` (spans printed to stderr) or an OpenTelemetry exporter is
configured by the embedding application; propagation costs nothing when no span is active.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

tracer = trace.get_tracer("jetshard")
_enabled = False
"""Without a configured provider every span is a no-op; skipping them keeps the sequencer's hot path lean."""


def configure_tracing(service: str) -> None:
    global _enabled
    if os.environ.get("JETSHARD_TRACE", "").lower() != "console":
        return
    _enabled = True
    provider = TracerProvider(resource=Resource.create({"service.name": f"jetshard-{service}"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (if any) to outgoing NATS headers."""
    if _enabled:
        propagate.inject(headers)
    return headers


@contextmanager
def span_from(headers: Mapping[str, str] | None, name: str) -> Iterator[None]:
    """A span continuing the trace whose context arrived in `headers`."""
    if not _enabled:
        yield
        return
    token = context.attach(propagate.extract(dict(headers or {})))
    try:
        with tracer.start_as_current_span(name):
            yield
    finally:
        context.detach(token)
