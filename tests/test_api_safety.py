"""The HTTP API as a web page or a rebound DNS name would reach it: an API key when one is set, an allow-list
of `Host`s, no state change from a foreign `Origin` or in a body a cross-site form can send, and a 400 (not a
500) for a body nested too deeply. Every refusal is in the OpenAI error shape."""

from __future__ import annotations

import httpx
import pytest
from jetshard_api.safety import allowed_hosts_for, host_of
from test_api_core import assert_openai_error

pytestmark = pytest.mark.timeout(120)

KEY = "test-key-0123456789"
DOWNLOAD = {"model_id": "org/model", "node_id": "nowhere"}


def test_allowed_hosts_are_loopback_plus_the_listen_address_plus_extras() -> None:
    assert allowed_hosts_for("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    loopback = {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts_for("10.1.2.3", ("Box.Example.",)) == loopback | {"10.1.2.3", "box.example"}
    everywhere = allowed_hosts_for("0.0.0.0")
    assert {"127.0.0.1", "::1"} <= everywhere and len(everywhere) > 4  # interface addresses and the hostname
    assert [host_of(h) for h in ("127.0.0.1:80", "[::1]:8080", "LOCALHOST", "::1", "evil:1")] == [
        "127.0.0.1",
        "::1",
        "localhost",
        "::1",
        "evil",
    ]


async def test_api_key_host_origin_content_type_and_nesting(processes, fresh_nats) -> None:
    processes.start("sequencer", "sequencer", "--nats", fresh_nats.url)
    base = processes.start_api("api", "--nats", fresh_nats.url, "--api-key", KEY)
    bearer = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.get("/healthz")).status_code == 200  # open: a load balancer has no key
        health = await client.get("/health")  # vLLM's and llama-server's probe, open too
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (await client.get("/openapi/openapi.json")).status_code == 200
        # The dashboard's page and files hold no data; the view they show needs the key like every route.
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/dashboard/app.js")).status_code == 200
        assert_openai_error(await client.get("/view/stream"), 401)
        assert (await client.get("/view", headers=bearer)).status_code == 200

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
            error = assert_openai_error(await client.get("/v1/models", headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert (await client.get("/v1/models", headers=bearer)).status_code == 200
        assert (await client.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200  # Anthropic clients

        # DNS rebinding: the page's own name reaches this port; only the names the API answers to pass.
        error = assert_openai_error(await client.get("/healthz", headers={"Host": "evil.example"}), 400)
        assert error["code"] == "host_not_allowed"
        port = base.rsplit(":", 1)[1]
        assert (await client.get("/healthz", headers={"Host": f"localhost:{port}"})).status_code == 200

        # The exact request that used to be accepted: a cross-site form post.
        attack = {**bearer, "Origin": "http://evil.example", "Content-Type": "text/plain"}
        response = await client.post("/downloads", content=b'{"model_id": "org/model"}', headers=attack)
        assert_openai_error(response, 403)
        response = await client.post("/downloads", json=DOWNLOAD, headers={**bearer, "Origin": "http://evil.example"})
        assert assert_openai_error(response, 403)["code"] == "origin_not_allowed"
        response = await client.post(
            "/downloads", content=b'{"model_id": "org/model"}', headers={**bearer, "Content-Type": "text/plain"}
        )
        assert assert_openai_error(response, 415)["code"] == "unsupported_media_type"
        response = await client.delete("/instances/inst-x", headers={**bearer, "Origin": "null"})
        assert_openai_error(response, 403)
        # Ollama's routes read any body as JSON, as Ollama does: a cross-site page is still turned away by its origin.
        pull = b'{"model": "org/model"}'
        response = await client.post("/api/pull", content=pull, headers=attack)
        assert response.status_code == 403, response.text
        response = await client.post("/api/pull", content=pull, headers={**attack, "Origin": "null"})
        assert response.status_code == 403, response.text
        # Same-origin (the docs page served by this API) is fine: the request reaches its route.
        response = await client.post("/downloads", json=DOWNLOAD, headers={**bearer, "Origin": base})
        assert response.status_code not in (401, 403, 415), response.text

        deep = b'{"model": "org/model", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        response = await client.post(
            "/v1/chat/completions", content=deep, headers={**bearer, "Content-Type": "application/json"}
        )
        assert "nested too deeply" in str(assert_openai_error(response, 400)["message"])


async def test_cors_is_off_unless_configured(processes, fresh_nats) -> None:
    processes.start("sequencer", "sequencer", "--nats", fresh_nats.url)
    base = processes.start_api("api", "--nats", fresh_nats.url, "--cors-origin", "https://app.example")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        response = await client.get("/v1/models", headers={"Origin": "https://other.example"})
        assert "access-control-allow-origin" not in response.headers
        response = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        response = await client.post("/downloads", json=DOWNLOAD, headers={"Origin": "https://app.example"})
        assert response.status_code not in (401, 403, 415), response.text
