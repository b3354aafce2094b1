"""The API process: cluster routes, SSE, OpenAPI, OpenAI-shaped errors, restarts, 504 without a sequencer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.cards import tiny_card
from helpers.harness import api_until
from helpers.states import envelope_of
from jetshard_bus.connect import connect
from jetshard_bus.options import NatsOptions
from jetshard_schema.codec import encode
from jetshard_schema.events import CustomModelCardAdded

pytestmark = pytest.mark.timeout(120)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


async def first_event(client: httpx.AsyncClient, **request: Any) -> dict[str, Any]:
    """The first message of `GET /events`, checked against its SSE `id:` and `event:` fields."""
    async with client.stream("GET", "/events", **request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        async for line in response.aiter_lines():
            name, _, value = line.partition(":")
            fields[name] = value.strip()
            if name == "data":
                data: dict[str, Any] = json.loads(value)
                assert data["event"]["type"] == fields["event"] and str(data["seq"]) == fields["id"]
                return data
    raise AssertionError("the event stream ended before its first event")


async def append_card_events(url: str, *model_ids: str) -> None:
    """One CustomModelCardAdded event per id, appended by hand as a sequencer would have."""
    client, js = await connect(NatsOptions(servers=(url,)), "test")
    try:
        for model_id in model_ids:
            card = tiny_card(
                model_id,
                num_layers=2,
                hidden_size=8,
                num_attention_heads=1,
                num_key_value_heads=1,
                vocab_size=10,
                storage_size_bytes=1,
                is_custom=True,
            )
            envelope = envelope_of(CustomModelCardAdded(card=card), f"c-{model_id.replace('/', '--')}", command_seq=0)
            await js.publish(envelope.event.subject, encode(envelope))
    finally:
        await client.close()


async def test_cluster_routes(fresh_nats, processes, tmp_path: Path) -> None:
    processes.start("seq", "sequencer", "--nats", fresh_nats.url)
    processes.start("worker", "worker", "--nats", fresh_nats.url, env={"JETSHARD_CONFIG_DIR": str(tmp_path / "cfg")})
    base = processes.start_api("api1", "--nats", fresh_nats.url)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        health = (await client.get("/healthz")).json()
        assert health["status"] == "ok"

        nodes = await api_until(client, lambda body: len(body) == 1, "/nodes", timeout_s=30)
        node_id = (tmp_path / "cfg" / "node_id").read_text().strip()
        assert nodes[0]["node_id"] == node_id
        assert nodes[0]["profile"]["cpu_cores"] >= 1
        assert "model_dirs" in nodes[0]
        assert nodes[0]["profile"]["gpus"] == []  # no NVIDIA driver on this machine

        preview = await client.get("/instances/preview", params={"model_id": "mlx-community/Qwen3-0.6B-4bit"})
        assert preview.status_code == 200, preview.text
        assert [(s["node_id"], s["device"]) for s in preview.json()["shards"]] == [(node_id, "cpu")]
        # A node count below one is a bad request, not a placement that failed.
        for bad in (0, -3):
            params = {"model_id": "mlx-community/Qwen3-0.6B-4bit", "min_nodes": bad}
            for refused in (
                await client.get("/instances/preview", params=params),
                await client.post("/instances", json=params),
            ):
                assert "min_nodes" in str(assert_openai_error(refused, 400)["message"])
        # Tensor parallelism: the one node holds a slice of every layer (all of them, as tensor rank 0 of 1); the
        # model's 16 attention and 8 key/value heads do not split over 3 nodes; an unknown field is refused.
        qwen = "mlx-community/Qwen3-0.6B-4bit"
        tensor = await client.get("/instances/preview", params={"model_id": qwen, "parallelism": "tensor"})
        assert tensor.status_code == 200, tensor.text
        assert [(s["tensor_rank"], s["start_layer"], s["end_layer"]) for s in tensor.json()["shards"]] == [(0, 0, 28)]
        assert tensor.json()["serving"]["parallelism"] == "tensor"
        assert preview.json()["shards"][0]["tensor_rank"] is None
        params = {"model_id": qwen, "parallelism": "tensor", "min_nodes": 3}
        for refused in (
            await client.get("/instances/preview", params=params),
            await client.post("/instances", json=params),
        ):
            message = assert_openai_error(refused, 400)["message"]
            assert "16 attention heads and 8 key/value heads, which do not both divide by 3 nodes" in message
        # An id in a path that no instance, task or node could have is a 400 naming it, never a command.
        for method, path, param in [
            ("GET", "/instances/%E2%98%83", "instance_id"),
            ("PATCH", "/instances/" + "a" * 5000, "instance_id"),
            ("DELETE", "/instances/a.b", "instance_id"),
            ("DELETE", "/tasks/x.y", "task_id"),
            ("DELETE", "/downloads/-node/org/name", "node_id"),
        ]:
            body = {"keep_alive_s": 1} if method == "PATCH" else None
            error = assert_openai_error(await client.request(method, path, json=body), 400)
            assert error["param"] == param and "use letters, digits" in str(error["message"]), error
            assert len(str(error["message"])) < 200
        # A draft model no placement could use is the request's fault, on the preview as on the placement.
        for refused in (
            await client.get("/instances/preview", params={"model_id": qwen, "draft": "nope/nope"}),
            await client.post("/instances", json={"model_id": qwen, "serving": {"draft": "nope/nope"}}),
        ):
            assert "draft nope/nope is not a known model" in assert_openai_error(refused, 400)["message"]
        for refused in (
            await client.get("/instances/preview", params={"model_id": qwen, "paralelism": "tensor"}),
            await client.post("/instances", json={"model_id": qwen, "paralelism": "tensor"}),
        ):
            assert "paralelism" in str(assert_openai_error(refused, 400)["message"])

        # The engine: placement's choice shown; one the model has no weights for is a 400 naming it, an unknown one a
        # 400 listing the engines; llama.cpp where no node runs it a 409 (until its build is done there).
        assert (preview.json()["engine"], preview.json()["serving"]["engine"]) == ("mlx", "mlx")
        for refused in (
            await client.get("/instances/preview", params={"model_id": qwen, "engine": "llama.cpp"}),
            await client.post("/instances", json={"model_id": qwen, "engine": "llama.cpp"}),
        ):
            message = assert_openai_error(refused, 400)["message"]
            assert "has no gguf weights, which llama.cpp serves (it has mlx)" in message
        error = assert_openai_error(await client.post("/instances", json={"model_id": qwen, "engine": "vllm"}), 400)
        assert error["param"] == "engine" and 'engine is one of: "mlx", "llama.cpp"' in str(error["message"])
        assert_openai_error(await client.get("/instances/preview", params={"model_id": qwen, "engine": "vllm"}), 400)
        if "llama.cpp" not in nodes[0]["profile"]["engines"]:
            demo = "jetshard/SmolLM2-135M-Instruct-Q4"
            for refused in (
                await client.get("/instances/preview", params={"model_id": demo, "engine": "llama.cpp"}),
                await client.post("/instances", json={"model_id": demo, "engine": "llama.cpp"}),
            ):
                assert "no node runs llama.cpp" in str(assert_openai_error(refused, 409)["message"])

        # A value of the wrong type is refused, not converted, naming the field at fault.
        for body, param in (
            ({"min_nodes": "2"}, "min_nodes"),
            ({"serving": {"max_batch": "4"}}, "serving"),
            ({"serving": {"prefix_cache_bytes": 1.0}}, "serving"),
            ({"parallelism": 1}, "parallelism"),
        ):
            error = assert_openai_error(await client.post("/instances", json={"model_id": qwen, **body}), 400)
            assert (error["param"], error["code"]) == (param, "invalid_type"), error
        refused = await client.post("/downloads", json={"model_id": qwen, "node_id": node_id, "start_layer": "0"})
        assert assert_openai_error(refused, 400)["param"] == "start_layer"

        # A node named twice, or unknown, is a 400 to fix (no memory would place it), and names each node once.
        for node_ids, words in (
            ([node_id] * 3, f"node_ids lists {node_id} more than once"),
            (["x"], "unknown node(s): x;"),
        ):
            for parallelism in ("pipeline", "tensor"):
                body = {"model_id": qwen, "node_ids": node_ids, "parallelism": parallelism}
                assert words in str(assert_openai_error(await client.post("/instances", json=body), 400)["message"])
        # No node named is a 400, not "choose for me" (which leaving node_ids out, or null, means); more ids than a
        # cluster may have are refused as they are decoded; unknown ones are named a few, not echoed back in full.
        for node_ids in ([], [f"x{n}" for n in range(5000)]):
            refused = await client.post("/instances", json={"model_id": qwen, "node_ids": node_ids})
            assert assert_openai_error(refused, 400)["param"] == "node_ids"
            assert len(refused.content) < 1000
        refused = await client.post("/instances", json={"model_id": qwen, "node_ids": [f"x{n}" for n in range(4096)]})
        message = assert_openai_error(refused, 400)["message"]
        assert message == "unknown node(s): x0, x1, x2 and 4093 more; see GET /nodes"
        # More nodes than the cluster has: a 409 of its own, not a lack of memory.
        params = {"model_id": qwen, "min_nodes": 2}
        for refused in (
            await client.get("/instances/preview", params=params),
            await client.post("/instances", json=params),
        ):
            error = assert_openai_error(refused, 409)
            assert (error["code"], error["message"]) == ("not_enough_nodes", "2 node(s) requested but only 1 available")

        state = (await client.get("/state")).json()
        assert state["last_seq"] >= 1
        assert node_id in state["nodes"]

        # the event stream as Server-Sent Events, from the first event
        first = await first_event(client, params={"since": 1})
        assert first["seq"] == 1
        assert first["event"]["type"] == "NodeJoined"
        assert first["event"]["node_id"] == node_id

        schema = (await client.get("/openapi/openapi.json")).json()
        assert schema["info"]["title"] == "jetshard"
        assert "/state" in schema["paths"] and "/events" in schema["paths"]
        # The placement and reasoning fields, asked and answered; an answer that may also stream is documented too.
        components = schema["components"]["schemas"]

        def fields(component: str) -> set[str]:
            return set(components[component]["properties"])

        assert {"parallelism", "node_ids", "min_nodes", "engine"} <= fields("PlaceRequest")
        assert {"engine", "engine_chosen"} <= fields("InstanceDescription") and "engines" in fields("ModelObject")
        assert {"bfloat16", "float16"} <= set(components["WeightsDtype"]["enum"])
        assert {"weights", "tensor_rank", "device"} <= fields("ShardDescription")
        assert "parallelism" in {p["name"] for p in schema["paths"]["/instances/preview"]["get"]["parameters"]}
        assert {"chat_template_kwargs", "reasoning_effort"} <= fields("ChatCompletionRequest")
        assert "budget_tokens" in fields("ThinkingParam") and "think" in fields("ChatRequest")
        assert "capabilities" in fields("ModelObject")
        for path, answer in (
            ("/v1/chat/completions", "ChatCompletion"),
            ("/v1/responses", "ResponseObject"),
            ("/v1/messages", "MessageBody"),
            ("/api/chat", "ChatAnswer"),
        ):
            documented = schema["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
            assert documented["$ref"].endswith(answer), path  # the same name in two dialects gets a prefix
        assert "reasoning_content" in fields("openai_types_AssistantMessage")
        assert "completion_tokens_details" in fields("openai_types_UsageBody")
        assert "thinking" in fields("ThinkingBlock") and "thinking" in fields("ollama_types_AssistantMessage")

        assert_openai_error(await client.get("/no/such/route"), 404)
        error = assert_openai_error(
            await client.post("/models", content=b"x" * (9 * 2**20), headers={"content-type": "application/json"}),
            413,
        )
        assert error["code"] == "request_too_large"

        # a rejected command in OpenAI shape: deleting a built-in card is a conflict
        assert_openai_error(await client.delete("/models/mlx-community/Qwen3-0.6B-4bit"), 409)
        final = (await client.get("/state")).json()

    # a restarted API rebuilds the same State from the stream
    processes.kill(processes.started[-1])
    base = processes.start_api("api2", "--nats", fresh_nats.url)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        again = await api_until(client, lambda body: body["last_seq"] >= final["last_seq"], "/state", timeout_s=30)
        again_nodes = (await client.get("/nodes")).json()
    assert {k: v for k, v in again.items() if k != "last_seq"} == {
        k: v for k, v in final.items() if k != "last_seq"
    } or again["last_seq"] > final["last_seq"]
    assert [n["node_id"] for n in again_nodes] == [node_id]


async def test_a_state_changing_route_answers_504_without_a_sequencer(fresh_nats, processes) -> None:
    # A custom card in State (its event appended by hand, as a sequencer would have), so that deleting it
    # passes the API's own checks and publishes a command that no sequencer is there to answer.
    await append_card_events(fresh_nats.url, "acme/orphan")
    base = processes.start_api("api", "--nats", fresh_nats.url, "--command-timeout-s", "1")
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        await api_until(http, lambda body: "acme/orphan" in body["custom_cards"], "/state", timeout_s=30)
        error = assert_openai_error(await http.delete("/models/acme/orphan"), 504)
    assert error["type"] == "timeout_error"
    assert error["code"] == "command_timeout"
    assert "sequencer" in str(error["message"])


async def test_events_resume_after_last_event_id(fresh_nats, processes) -> None:
    await append_card_events(fresh_nats.url, "acme/one", "acme/two", "acme/three")
    base = processes.start_api("api", "--nats", fresh_nats.url)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        # An EventSource reconnects to the URL it opened, `since` included, and says where it got to.
        resumed = await first_event(http, params={"since": 1}, headers={"Last-Event-ID": "2"})
        assert resumed["seq"] == 3 and resumed["event"]["card"]["model_id"] == "acme/three"
        assert (await first_event(http, headers={"Last-Event-ID": "1"}))["seq"] == 2
        assert (await first_event(http, params={"since": 2}))["seq"] == 2
        for bad in ("two", "-1", "1.5", "", str(2**64), "1" * 5000):  # int() refuses over 4300 digits itself
            error = assert_openai_error(await http.get("/events", headers={"Last-Event-ID": bad}), 400)
            assert error["param"] == "Last-Event-ID" and error["code"] == "invalid_value"
        for bad in (-5, 2**64):  # past JetStream's sequences the stream used to open, then break
            error = assert_openai_error(await http.get("/events", params={"since": bad}), 400)
            assert error["param"] == "since" and error["code"] == "invalid_value"


async def test_the_docs_page_loads_every_asset_from_the_api(fresh_nats, bus, processes) -> None:
    """`bus` declares the streams, as a sequencer would: the API waits for them."""
    base = processes.start_api("api", "--nats", fresh_nats.url)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        page = await http.get("/openapi")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assets = re.findall(r"""<(?:script|link)\b[^>]*\b(?:src|href)=["']([^"']+)["']""", page.text)
        elsewhere = [url for url in assets if not url.startswith("/") or url.startswith("//")]
        assert elsewhere == [], "the docs page loads these from outside the API"
        assert {Path(url).suffix for url in assets} >= {".js", ".css"}, assets
        for url in assets:
            asset = await http.get(url)
            assert asset.status_code == 200 and asset.content, url
            if url.endswith(".js"):
                assert "javascript" in asset.headers["content-type"] and b"SwaggerUI" in asset.content, url
            elif url.endswith(".css"):
                assert asset.headers["content-type"].startswith("text/css") and b".swagger-ui" in asset.content, url
