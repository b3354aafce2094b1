"""Model catalogue routes: built-in and custom cards, with per-node download status."""

from __future__ import annotations

import asyncio

import msgspec
from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.commands import AddCustomModelCard, DeleteCustomModelCard
from jetshard_schema.ids import NodeId
from jetshard_schema.models import all_cards, find_card, is_builtin
from jetshard_schema.state import Download, State
from litestar import Controller, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.strict_body import StrictBody
from jetshard_api.errors import ERROR_RESPONSES, ApiError
from jetshard_api.hub import fetch_card
from jetshard_api.route_steps import Deleted, checked_model_id


class AddModelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_id: str
    card: ModelCard | None = None
    """Only for models imported from a local GGUF file (`jetshard models import-gguf`): the card built from
    the converted files. Every other card is fetched from the Hub. Its fields are bounded as every card's are
    (`ModelCard.__post_init__`); a field this version does not know is ignored, as on the bus, so a newer CLI's
    card still adds."""


class ModelDescription(ModelCard, frozen=True, kw_only=True):
    downloads: dict[NodeId, Download]
    """This model's download on each node that has one."""


def describe(state: State, card: ModelCard) -> ModelDescription:
    downloads = {
        node_id: per_node[card.model_id]
        for node_id, per_node in sorted(state.downloads.items())
        if card.model_id in per_node
    }
    return ModelDescription(**msgspec.structs.asdict(card), downloads=downloads)


class ModelsController(Controller):
    dto = StrictBody  # a value of the wrong type is refused, not converted ("30" is not 30)
    return_dto = None
    path = "/models"
    tags = ["models"]

    @get("/", responses=ERROR_RESPONSES)
    async def list_models(self, cluster: NamedDependency[Cluster]) -> list[ModelDescription]:
        state = cluster.state
        return [describe(state, card) for card in all_cards(state).values()]

    @get("/{org:str}/{name:str}", responses=ERROR_RESPONSES)
    async def show_model(
        self, cluster: NamedDependency[Cluster], org: FromPath[str], name: FromPath[str]
    ) -> ModelDescription:
        model_id = checked_model_id(f"{org}/{name}")
        card = find_card(cluster.state, model_id)
        if card is None:
            raise ApiError(404, f"unknown model {model_id}", "model_not_found")
        return describe(cluster.state, card)

    @post(
        "/",
        status_code=201,
        responses={**ERROR_RESPONSES, 200: ResponseSpec(ModelDescription, description="the model exists already")},
    )
    async def add_model(
        self, cluster: NamedDependency[Cluster], data: JSONBody[AddModelRequest]
    ) -> Response[ModelDescription]:
        """Fetch a card from the Hub and add it to every node; 200 with the card if it exists already."""
        model_id = checked_model_id(data.model_id)
        if (existing := find_card(cluster.state, model_id)) is not None:
            return Response(describe(cluster.state, existing), status_code=200)
        if data.card is not None:
            if data.card.model_id != model_id or data.card.source is not ModelSource.LOCAL_GGUF:
                raise ApiError(
                    400,
                    "a card may be supplied only for a model imported from a local GGUF file, with the same model_id",
                    "invalid_card",
                    "card",
                )
            card = data.card
        else:
            card = await asyncio.to_thread(fetch_card, model_id)
        try:
            await cluster.submit(AddCustomModelCard(card=card))
        except ApiError as error:
            if error.code != "already_exists":
                raise
            return Response(describe(cluster.state, find_card(cluster.state, model_id) or card), status_code=200)
        return Response(describe(cluster.state, find_card(cluster.state, model_id) or card), status_code=201)

    @delete("/{org:str}/{name:str}", status_code=200, responses=ERROR_RESPONSES)
    async def delete_model(self, cluster: NamedDependency[Cluster], org: FromPath[str], name: FromPath[str]) -> Deleted:
        """Delete a custom card; downloaded files stay where they are."""
        model_id = checked_model_id(f"{org}/{name}")
        if is_builtin(model_id):
            raise ApiError(409, f"{model_id} is a built-in card; only custom cards can be deleted", "builtin_card")
        if model_id not in cluster.state.custom_cards:
            raise ApiError(404, f"no custom model card {model_id}", "model_not_found")
        await cluster.submit(DeleteCustomModelCard(model_id=model_id))
        return Deleted(deleted=model_id)
