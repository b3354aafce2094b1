"""The Litestar application: routes, error shapes, OpenAPI."""

from __future__ import annotations

from jetshard_bus import tracing
from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.plugins import PluginProtocol
from litestar.static_files import create_static_files_router
from litestar.types import Message, Scope
from swagger_ui_bundle import swagger_ui_path

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.anthropic.routes import AnthropicController
from jetshard_api.dialects.ollama.routes import OllamaController
from jetshard_api.dialects.openai.routes import OpenAIController
from jetshard_api.dialects.responses.routes import ResponsesController
from jetshard_api.errors import error_handlers_by_path
from jetshard_api.routes_cluster import ClusterController
from jetshard_api.routes_dashboard import dashboard_routes
from jetshard_api.routes_downloads import DownloadsController
from jetshard_api.routes_instances import InstancesController
from jetshard_api.routes_models import ModelsController
from jetshard_api.routes_settings import SettingsController
from jetshard_api.routes_view import ViewController
from jetshard_api.safety import HttpSafety, HttpSafetyMiddleware
from jetshard_api.settings import InferenceSettings

MAX_REQUEST_BYTES = 8 * 2**20
"""An HTTP body larger than NATS's (raised) max payload could not be carried as a command: 413."""

OPENAPI_PATH = "/openapi"
SWAGGER_UI_ASSETS_PATH = f"{OPENAPI_PATH}/assets"
"""Swagger UI's files, served from the `swagger-ui-bundle-v2` package: the docs page works offline (Litestar's
default pages load them from a CDN)."""


def _openapi_config() -> OpenAPIConfig:
    swagger_ui = SwaggerRenderPlugin(
        js_url=f"{SWAGGER_UI_ASSETS_PATH}/swagger-ui-bundle.js",
        css_url=f"{SWAGGER_UI_ASSETS_PATH}/swagger-ui.css",
        standalone_preset_js_url=f"{SWAGGER_UI_ASSETS_PATH}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{SWAGGER_UI_ASSETS_PATH}/favicon-32x32.png'>",
        path="/",
    )
    return OpenAPIConfig(title="jetshard", version="0.1.0", path=OPENAPI_PATH, render_plugins=[swagger_ui])


def _plugins() -> list[PluginProtocol]:
    """A server span per HTTP request, parent of what the request causes, while tracing is on. Its spans of
    each body part received and sent are left out: a streamed answer would make one per chunk."""
    if not tracing.enabled():
        return []
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    return [OpenTelemetryPlugin(OpenTelemetryConfig(exclude_spans=["receive", "send"]))]


def create_app(
    cluster: Cluster, inference: InferenceSettings = InferenceSettings(), safety: HttpSafety = HttpSafety()
) -> Litestar:
    async def provide_cluster() -> Cluster:
        return cluster

    async def provide_inference() -> InferenceSettings:
        return inference

    async def count_response(message: Message, scope: Scope) -> None:
        if message["type"] == "http.response.start":
            cluster.metrics.count_response(scope, message["status"])

    return Litestar(
        route_handlers=[
            ClusterController,
            ModelsController,
            InstancesController,
            OpenAIController,
            AnthropicController,
            OllamaController,
            ResponsesController,
            DownloadsController,
            SettingsController,
            ViewController,
            create_static_files_router(
                SWAGGER_UI_ASSETS_PATH, directories=[swagger_ui_path], name="swagger-ui", include_in_schema=False
            ),
            *dashboard_routes(),
        ],
        dependencies={
            "cluster": Provide(provide_cluster, use_cache=True),
            "settings": Provide(provide_inference, use_cache=True),
        },
        exception_handlers=error_handlers_by_path(
            {
                OllamaController.path: OllamaController.exception_handlers,
                AnthropicController.path: AnthropicController.exception_handlers,
            }
        ),
        middleware=[HttpSafetyMiddleware(safety)],
        before_send=[count_response],
        cors_config=CORSConfig(allow_origins=list(safety.cors_origins)) if safety.cors_origins else None,
        openapi_config=_openapi_config(),
        plugins=_plugins(),
        request_max_body_size=MAX_REQUEST_BYTES,
    )
