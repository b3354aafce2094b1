"""The Litestar application: routes, error shapes, OpenAPI."""

from __future__ import annotations

from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from jetshard_api.cluster import Cluster
from jetshard_api.errors import ApiError, api_error_handler, http_error_handler, internal_error_handler
from jetshard_api.routes_cluster import ClusterController
from jetshard_api.routes_downloads import DownloadsController
from jetshard_api.routes_instances import InstancesController
from jetshard_api.routes_models import ModelsController
from jetshard_api.routes_openai import InferenceSettings, OpenAIController

MAX_REQUEST_BYTES = 8 * 2**20
"""An HTTP body larger than NATS's (raised) max payload could not be carried as a command: 413."""


def create_app(cluster: Cluster, inference: InferenceSettings = InferenceSettings()) -> Litestar:
    async def provide_cluster() -> Cluster:
        return cluster

    async def provide_inference() -> InferenceSettings:
        return inference

    return Litestar(
        route_handlers=[
            ClusterController,
            ModelsController,
            InstancesController,
            OpenAIController,
            DownloadsController,
        ],
        dependencies={
            "cluster": Provide(provide_cluster, use_cache=True),
            "settings": Provide(provide_inference, use_cache=True),
        },
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        openapi_config=OpenAPIConfig(title="jetshard", version="0.1.0", path="/openapi"),
        request_max_body_size=MAX_REQUEST_BYTES,
    )
