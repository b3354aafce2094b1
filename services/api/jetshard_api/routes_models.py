"""Model catalogue routes: built-in and custom cards, with per-node download status."""

from __future__ import annotations

import asyncio

import msgspec
from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.commands import AddCustomModelCard, DeleteCustomModelCard, ImportModelFile, NodePath
from jetshard_schema.gguf_card import HubGgufRef
from jetshard_schema.ids import NodeId, import_model_id, new_id
from jetshard_schema.models import all_cards, find_card, is_builtin
from jetshard_schema.state import Download, State
from jetshard_schema.types import ImportStatus
from litestar import Response, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody

from jetshard_api.cluster import Cluster
from jetshard_api.dialects.strict_body import StrictController
from jetshard_api.errors import ERROR_RESPONSES, ApiError, refused_as_bad_request
from jetshard_api.hub import checked_gguf_file, fetch_card, fetch_gguf_card
from jetshard_api.model_steps import Deleted, checked_model_id


class AddModelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_id: str
    """The card's id: the Hub repo, unless `repo` names it."""
    gguf_file: str = ""
    """A GGUF file's path in the repo (a split model's first part, `...-00001-of-0000N.gguf`): the card is read from
    its header, and llama.cpp serves it (MLX too, where it converts the file)."""
    repo: str = ""
    """The Hub repo of `gguf_file`, where the card's id is another: a second quantization of one repo needs an id
    of its own (`{"model_id": "me/qwen3-0.6b-q8", "repo": "Qwen/Qwen3-0.6B-GGUF", "gguf_file": "...Q8_0.gguf"}`)."""
    mmproj_file: str = ""
    """With `gguf_file`: the repo's projector file (mmproj) for a model that sees."""
    card: ModelCard | None = None
    """Only for models imported from a local GGUF file (`jetshard models import-gguf`): the card built from
    the converted files. Every other card is fetched from the Hub. Its fields are bounded as every card's are
    (`ModelCard.__post_init__`); a field this version does not know is ignored, as on the bus, so a newer CLI's
    card still adds."""


class ImportModelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node_id: str
    """The node that has the file; its downloader imports it."""
    path: NodePath
    """An absolute path on that node."""
    model_id: str = ""
    """The id to serve it as; by default `local/<file name>`."""
    mmproj_path: NodePath = ""
    replace: bool = False


IMPORT_TIMEOUT_S = 3600.0
"""An import links the file (instant) or copies it where it cannot (some seconds a gigabyte)."""


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


class ModelsController(StrictController):
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
        """Fetch a card from the Hub and add it to every node; 200 with the card if it exists already.

        `{"model_id": "org/name"}`: a transformers-style repo's card, from its config files.
        `{"model_id": "org/name", "gguf_file": "x-Q4_K_M.gguf"}`: the card of one GGUF file of that repo, read from
        the file's header with Range requests (never its tensors), sized by the repo's listing (every part of a
        split model); nodes download only that file (and its parts, and the projector named by `mmproj_file`).
        `"repo"` gives the repo where the card's id is another (a second quantization of one repo): then
        `model_id` is any valid id of the cluster's. A missing repo 404, a gated one 403, a missing file 404
        naming the repo's GGUF files, a file that is not GGUF or not a model llama.cpp loads 400 naming it."""
        model_id = checked_model_id(data.model_id)
        if data.gguf_file and data.card is not None:
            raise ApiError(400, "a card and gguf_file exclude each other", "invalid_request_error", "card")
        if data.gguf_file:
            ref = HubGgufRef(
                checked_model_id(data.repo, "repo") if data.repo else model_id,
                checked_gguf_file(data.gguf_file, "gguf_file"),
                checked_gguf_file(data.mmproj_file, "mmproj_file") if data.mmproj_file else "",
            )
        elif data.repo or data.mmproj_file:
            field = "repo" if data.repo else "mmproj_file"
            raise ApiError(
                400, f"{field} goes with gguf_file, the GGUF file it belongs to", "invalid_request_error", field
            )
        if (existing := find_card(cluster.state, model_id)) is not None:
            if data.gguf_file and existing.source_ref != str(ref):
                raise ApiError(
                    409,
                    f"{model_id} is a card already, of {existing.source_ref or existing.source}, not {ref}; delete it "
                    f"first (DELETE /models/{model_id}) or give this file another model_id, with repo",
                    "already_exists",
                    "model_id",
                )
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
        elif data.gguf_file:
            card = await asyncio.to_thread(fetch_gguf_card, model_id, ref)
        else:
            card = await asyncio.to_thread(fetch_card, model_id)
        try:
            await cluster.submit(AddCustomModelCard(card=card))
        except ApiError as error:
            if error.code != "already_exists":
                raise
            return Response(describe(cluster.state, find_card(cluster.state, model_id) or card), status_code=200)
        return Response(describe(cluster.state, find_card(cluster.state, model_id) or card), status_code=201)

    @post("/import", status_code=201, responses=ERROR_RESPONSES)
    async def import_model(
        self, cluster: NamedDependency[Cluster], data: JSONBody[ImportModelRequest]
    ) -> ModelDescription:
        """Import a GGUF file on a node: its downloader reads the card from the file's header and stores the file in
        one of its model directories; answers once it has, with the card, or 400 naming what is wrong with it."""
        with refused_as_bad_request("invalid_model_id", "model_id"):
            model_id = import_model_id(data.model_id, data.path)
        if data.node_id not in cluster.state.nodes:
            raise ApiError(404, f"unknown node {data.node_id}; see GET /nodes", "node_not_found", "node_id")
        import_id = new_id()
        command = ImportModelFile(
            import_id=import_id,
            node_id=NodeId(data.node_id),
            model_id=model_id,
            path=data.path,
            mmproj_path=data.mmproj_path,
            replace=data.replace,
        )
        await cluster.submit(command)

        def finished(state: State) -> bool:
            record = state.imports.get(model_id)
            return record is None or record.import_id != import_id or record.progress.status is not ImportStatus.ONGOING

        try:
            state = await cluster.wait_until(finished, IMPORT_TIMEOUT_S)
        except TimeoutError as error:
            raise ApiError(504, f"the import of {model_id} did not finish in time", "import_timeout") from error
        record = state.imports.get(model_id)
        if record is None or record.import_id != import_id:
            raise ApiError(
                409, f"the import of {model_id} was superseded (its card deleted, or imported again)", "conflict"
            )
        if record.progress.status is ImportStatus.FAILED:
            raise ApiError(400, record.progress.reason, "import_failed", "path")
        card = find_card(state, model_id)
        if card is None:
            raise ApiError(409, f"{model_id} was imported, then its card was deleted", "conflict")
        return describe(state, card)

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
