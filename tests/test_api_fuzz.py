"""Schemathesis against the OpenAPI schema the API serves, on a one-node cluster serving a tiny model.

No 500s, every status (503 and 504 included) is documented for its operation, responses match their
documented schemas, and every error is in the OpenAI error shape (Ollama's under /api).
Destructive operations (DELETE) run last, so the earlier ones see a cluster with its model in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from helpers.harness import InferenceCluster, hub_cluster
from helpers.tiny_models import make_tiny_model
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "fuzz/tiny-llama"
MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceCluster]:
    root = tmp_path_factory.mktemp("api-fuzz")
    with hub_cluster(root) as cluster:
        cluster.hub.add_repo(MODEL, make_tiny_model(root / "repos" / "tiny", arch="llama", num_layers=2, num_files=1))
        cluster.start_core()
        cluster.serve_one_node(MODEL)
        yield cluster


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error names what went wrong the way OpenAI clients expect: {"error": {"message", "type", ...}};
    under /api, the way Ollama's do: {"error": message}."""
    if response.status_code < 400:
        return None
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    if case.path.startswith("/api/"):
        assert isinstance(error, str) and list(body) == ["error"], (
            f"{response.status_code} is not an Ollama-shaped error: {response.text[:300]}"
        )
        return None
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), (
        f"{response.status_code} is not an OpenAI-shaped error: {response.text[:300]}"
    )
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
    openai_error_shape,
]


def fuzz(api: str, destructive: bool) -> None:
    """Up to MAX_EXAMPLES generated requests per operation, each answered within the checks above."""
    api_schema = schemathesis.openapi.from_url(f"{api}/openapi/openapi.json")
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper() == "DELETE") != destructive or operation.path in ("/events", "/view/stream"):
            continue  # both stream forever

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case: Any) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        call()


def test_operations_that_keep_the_cluster(fuzz_cluster: InferenceCluster) -> None:
    fuzz(fuzz_cluster.api, destructive=False)


def test_destructive_operations(fuzz_cluster: InferenceCluster) -> None:
    fuzz(fuzz_cluster.api, destructive=True)
