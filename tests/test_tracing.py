"""Tracing: one chat through a cluster of separate processes is one trace, one tree of spans, exported over
OTLP/HTTP (as `OTEL_EXPORTER_OTLP_ENDPOINT` asks) to a receiver this module runs; and with no `OTEL_*` variable
set, tracing installs nothing.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from helpers.harness import InferenceCluster, hub_cluster, wait_for
from helpers.tiny_models import make_tiny_model
from jetshard_bus import tracing
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider

pytestmark = pytest.mark.timeout(180)

TINY_MODEL = "jetshard-test/tiny-traced"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on a loopback port: it keeps every span the services export."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._keep(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received = ReceivedSpan(
                        service=resource.get("service.name", ""),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                    )
                    with self._lock:
                        self.spans.append(received)

    def matching(self, attribute: str, value: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.attributes.get(attribute) == value]

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("tracing")
    model_dir = make_tiny_model(root / "repos" / "tiny", arch="llama", num_layers=2, num_files=1, seed=7)
    # Every service, and the runner the worker starts, inherits this environment; spans leave within 0.1 s.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with hub_cluster(root, env=env) as cluster:
        cluster.hub.add_repo(TINY_MODEL, model_dir)
        cluster.start_core()
        cluster.serve_one_node(TINY_MODEL)
        yield cluster


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[str]:
    """The names of the span's ancestors, nearest first."""
    names = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        names.append(span.name)
    return names


def test_a_chat_is_one_trace_forming_one_tree(traced_cluster: InferenceCluster, receiver: OtlpReceiver) -> None:
    client = openai.OpenAI(base_url=f"{traced_cluster.api}/v1", api_key="unused", timeout=60, max_retries=0)
    completion = client.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "Where is Paris?"}], max_tokens=4
    )
    task_id = "task-" + completion.id.removeprefix("chatcmpl-")

    def naming_the_task() -> list[ReceivedSpan]:
        return receiver.matching("jetshard.task_id", task_id)

    assert wait_for(lambda: any(s.name == "runner task" for s in naming_the_task()), timeout=20), (
        receiver.spans,
        traced_cluster.logs(),
    )
    (trace_id,) = {s.trace_id for s in naming_the_task()}  # every span naming the task is in one trace
    wanted = {"POST /v1/chat/completions", "command SubmitTask", "sequencer SubmitTask", "prefill", "decode"}
    assert wait_for(lambda: wanted <= {s.name for s in receiver.trace(trace_id)}, timeout=20), receiver.trace(trace_id)
    spans = receiver.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)

    # One tree: every parent is a span of the trace, but the one root, the HTTP request's span.
    (root,) = [s for s in spans if s.parent_id not in by_id]
    assert (root.name, root.parent_id, root.service) == ("POST /v1/chat/completions", "", "jetshard-api")
    named = {s.name: s for s in spans}
    # HTTP -> the API publishing the command -> the sequencer handling it -> the runner's prefill and decode.
    assert named["command SubmitTask"].service == "jetshard-api"
    assert "POST /v1/chat/completions" in _ancestors(named["command SubmitTask"], by_id)
    assert _ancestors(named["sequencer SubmitTask"], by_id)[0] == "command SubmitTask"
    assert named["sequencer SubmitTask"].service == "jetshard-sequencer"
    for phase in ("task queued", "prefill", "decode"):
        assert named[phase].service == "jetshard-runner"
        assert _ancestors(named[phase], by_id)[:2] == ["runner task", "sequencer SubmitTask"], phase
    assert len({s.service for s in spans}) >= 3

    task = named["runner task"]
    usage = completion.usage
    assert usage is not None
    assert task.attributes["gen_ai.request.model"] == TINY_MODEL
    assert task.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert task.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert task.attributes["jetshard.instance_id"] == named["sequencer SubmitTask"].attributes["jetshard.instance_id"]
    # No span holds the prompt.
    assert not any("Where is Paris" in str(value) for s in spans for value in s.attributes.values())


def test_without_otel_variables_tracing_installs_nothing() -> None:
    tracing.configure_tracing("api", environ={"OTEL_SERVICE_NAME": "named-but-not-exported"})
    assert not tracing.enabled()
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    assert tracing.inject({}) == {}
    with tracing.span_from({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "x") as span:
        assert span is None


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console,bogus"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ],
)
def test_the_environment_chooses_the_exporters(environ: dict[str, str], exporters: list[str]) -> None:
    assert tracing.exporter_names(environ) == exporters


SPAN_AT_EXIT = """
from jetshard_bus import tracing
tracing.configure_tracing("runner/0")
with tracing.span("work"):
    pass
tracing.shutdown_tracing()
"""


@pytest.mark.parametrize(("named", "service"), [({}, "jetshard-runner"), ({"OTEL_SERVICE_NAME": "gpu-box"}, "gpu-box")])
def test_console_spans_are_flushed_at_shutdown(named: dict[str, str], service: str) -> None:
    # The batch processor would wait 5 s before exporting: only the flush at shutdown prints the span this soon.
    environ = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "60000", **named}
    done = subprocess.run([sys.executable, "-c", SPAN_AT_EXIT], env=environ, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert (printed["name"], printed["resource"]["attributes"]["service.name"]) == ("work", service)
