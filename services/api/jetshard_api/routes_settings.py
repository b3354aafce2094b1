"""Cluster settings: how long models placed for requests stay loaded once idle, for every API of the cluster."""

from __future__ import annotations

import msgspec
from jetshard_schema.commands import SetDefaultKeepAlive
from jetshard_schema.types import KEEP_LOADED
from litestar import get, put
from litestar.di import NamedDependency
from litestar.params import JSONBody

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ERROR_RESPONSES
from jetshard_api.model_steps import checked_keep_alive
from jetshard_api.settings import InferenceSettings, default_keep_alive_ms

KEPT_LOADED_S = -1
"""What `model_keep_alive_s` says of models kept loaded: a value a `PUT` takes back as it is (its null means
something else: each API's own flag)."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    model_keep_alive_s: float
    """How long a model placed for a request stays loaded with nothing to do, in seconds; -1: until removed."""
    cluster_wide: bool
    """Whether the cluster sets it (`PUT /settings`), rather than this API's `--model-keep-alive-s`."""


class SettingsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_keep_alive_s: float | None
    """Seconds (0: unload as soon as idle; negative: keep loaded); null: each API's own `--model-keep-alive-s`
    again."""


class SettingsController(StrictController):
    path = "/settings"
    tags = ["cluster"]

    @get("/", responses=ERROR_RESPONSES)
    async def show(self, cluster: NamedDependency[Cluster], settings: NamedDependency[InferenceSettings]) -> Settings:
        return _settings(cluster, settings)

    @put("/", responses=ERROR_RESPONSES)
    async def change(
        self,
        cluster: NamedDependency[Cluster],
        settings: NamedDependency[InferenceSettings],
        data: JSONBody[SettingsRequest],
    ) -> Settings:
        """Set how long models placed for requests from now on stay loaded once idle, on every API."""
        keep_alive = None
        if data.model_keep_alive_s is not None:
            keep_alive = checked_keep_alive(data.model_keep_alive_s, "model_keep_alive_s")
        await cluster.submit(SetDefaultKeepAlive(keep_alive_ms=keep_alive))
        return _settings(cluster, settings)


def _settings(cluster: Cluster, settings: InferenceSettings) -> Settings:
    keep_alive = default_keep_alive_ms(cluster.state, settings)
    return Settings(
        model_keep_alive_s=KEPT_LOADED_S if keep_alive == KEEP_LOADED else keep_alive / 1000,
        cluster_wide=cluster.state.default_keep_alive_ms is not None,
    )
