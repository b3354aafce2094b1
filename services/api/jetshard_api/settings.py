"""How this API serves, as `jetshard api` (and `jetshard up`, for the API it starts) sets it: a flag per field whose
`msgspec.Meta` gives its help (and bounds). Kept apart from the routes so that the command line reads them without
loading the API."""

from __future__ import annotations

from typing import Annotated

import msgspec
from jetshard_schema.state import State
from jetshard_schema.types import MAX_KEEP_ALIVE_MS, ServingSettings, keep_alive_ms

Seconds = Annotated[float, msgspec.Meta(gt=0)]
"""A duration that must be above zero."""


class ImageSettings(msgspec.Struct, frozen=True):
    """Where the API may read an image a request names instead of carrying it."""

    fetch_urls: Annotated[
        bool,
        msgspec.Meta(
            description="fetch the http(s) image URLs requests name (from this host: it reaches what the API reaches)",
            extra={"flag": "--fetch-image-urls"},
        ),
    ] = False
    fetch_timeout_s: Annotated[
        Seconds,
        msgspec.Meta(description="how long fetching one image URL may take", extra={"flag": "--image-fetch-timeout-s"}),
    ] = 10.0
    local_dirs: Annotated[
        tuple[str, ...],
        msgspec.Meta(
            description="a directory whose files requests may name as file:// image URLs (repeatable; none by default)",
            extra={"flag": "--image-dir", "directory": True},
        ),
    ] = ()


class InferenceSettings(msgspec.Struct, frozen=True):
    command_timeout_s: Annotated[
        float, msgspec.Meta(description="how long a route waits for its command's outcome before answering 504")
    ] = 30.0
    auto_place: Annotated[
        bool, msgspec.Meta(description="place a model that has no instance when a request asks for it")
    ] = True
    """It places one and waits for it to be ready."""
    ready_timeout_s: float = 600.0
    chunk_silence_s: Annotated[
        float, msgspec.Meta(description="a generation silent this long (after its first chunk) ends with an error")
    ] = 60.0
    start_timeout_s: Annotated[
        Seconds,
        msgspec.Meta(
            description="how long a request may wait in its instance's queue for its turn: one that could not start "
            "in this long at the instance's pace is refused with 429 at once; one admitted waits its turn, unless its "
            "instance samples nothing for twice this"
        ),
    ] = 300.0
    """The sequencer refuses the task, so that a queued request is not left to time out; an admitted one that
    waited too long ends with 504 only when its instance is stalled, not when it is slow."""
    first_chunk_timeout_s: Annotated[
        Seconds,
        msgspec.Meta(
            description="once its task started, how long a request waits for its first chunk (the prompt's prefill)"
        ),
    ] = 300.0
    stream_ping_s: Annotated[
        Seconds,
        msgspec.Meta(
            description="a streaming request waiting (for its model, in its instance's queue, for its prompt) is sent "
            "an SSE comment this often"
        ),
    ] = 5.0
    """So that proxies and clients with read timeouts keep the connection."""
    model_keep_alive_s: Annotated[
        float,
        msgspec.Meta(
            le=MAX_KEEP_ALIVE_MS / 1000,
            description="how long a model placed for a request stays loaded with nothing to do (negative: until "
            "removed); a request may say otherwise (Ollama's keep_alive); models placed by hand stay until removed",
        ),
    ] = 300.0
    """Ollama's default `keep_alive`, 5 minutes."""
    serving: ServingSettings = ServingSettings()
    """The serving settings of the instances this API places, where a request does not set them."""
    images: ImageSettings = ImageSettings()
    """Where the API may read images a request names by file or web address."""


def default_keep_alive_ms(state: State, settings: InferenceSettings) -> int:
    """How long an instance placed for a request stays loaded once idle: the cluster's setting (the dashboard's,
    `PUT /settings`), else this API's `--model-keep-alive-s`."""
    if state.default_keep_alive_ms is not None:
        return state.default_keep_alive_ms
    return keep_alive_ms(settings.model_keep_alive_s)
