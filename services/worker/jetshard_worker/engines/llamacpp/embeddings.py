"""Embeddings on llama.cpp. llama-server makes them only when started for them alone (`--embeddings`), so an
instance's first embedding task starts a second llama-server on the same GGUF, pooling the mean of the final norm's
outputs, L2-normalised: the embedding the MLX engine makes. Its weights are the same mmap'd file (the page cache
holds them once); what it adds is its small context's KV cache and compute buffer.

Should it die, the embedding rows it held fail clearly and the next embedding task starts it again: the instance's
chats, on the main llama-server, go on meanwhile (the main server dying still ends the runner, which restarts the
instance)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from .requests import ServerError
from .server import LlamaServer, ServerDied, ServerSettings

EMBEDDING_PATH = "/v1/embeddings"
EMBEDDING_CONTEXT_TOKENS = 4096
"""The longest input the embedding server takes (less where the instance's slots are smaller): its whole prompt goes
through in one physical batch, whose compute buffer grows with it."""
EMBEDDING_SLOTS = 1
"""Inputs embedded together. One: llama.cpp 0.3.36 gives one of two prompts that share a batch a wrong mean (the
same text embedded beside another differs by up to 0.18 in a component from itself embedded alone)."""

OnStarted = Callable[[str, int], None]
OnEmbedded = Callable[[str, list[float], int], None]
OnCancelled = Callable[[str], None]
OnFailed = Callable[[str, str, str], None]


@dataclass(frozen=True)
class EmbeddingRow:
    """One input of an embedding task: its token ids (a text tokenized by the model's own vocabulary)."""

    row_id: str
    tokens: list[int]


def embedding_settings(serving: ServerSettings) -> ServerSettings:
    """The embedding server beside the instance's `serving` llama-server: the same binary, model and threads."""
    return replace(
        serving,
        slots=EMBEDDING_SLOTS,
        context_per_slot=min(serving.context_per_slot, EMBEDDING_CONTEXT_TOKENS),
        prompt_cache_bytes=0,
        mmproj=None,
        embeddings=True,
    )


class Embedder:
    """The instance's embedding llama-server, started on the first row it is given (and again after it died)."""

    def __init__(
        self,
        settings: ServerSettings,
        load_timeout_s: float,
        *,
        on_started: OnStarted,
        on_embedded: OnEmbedded,
        on_cancelled: OnCancelled,
        on_failed: OnFailed,
    ) -> None:
        self.settings = settings
        self._load_timeout_s = load_timeout_s
        self._server: LlamaServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._starting: asyncio.Task[None] | None = None
        self._rows: dict[str, asyncio.Task[None]] = {}
        self._on_started = on_started
        self._on_embedded = on_embedded
        self._on_cancelled = on_cancelled
        self._on_failed = on_failed

    @property
    def context_length(self) -> int:
        """The longest input, in tokens, it embeds."""
        return self.settings.context_per_slot

    def submit(self, row: EmbeddingRow) -> None:
        self._rows[row.row_id] = asyncio.get_running_loop().create_task(self._embed(row))

    def cancel(self, row_id: str) -> None:
        task = self._rows.get(row_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in list(self._rows.values()):
            task.cancel()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, ServerDied, OSError):
                await self._starting
        await self._stop()

    async def _embed(self, row: EmbeddingRow) -> None:
        try:
            client = await self._running()
            self._on_started(row.row_id, len(row.tokens))
            # Token ids: the text was tokenized at admission, to check its length before anything ran.
            response = await client.post(EMBEDDING_PATH, json={"input": row.tokens, "encoding_format": "float"})
            body = response.json()
            if response.status_code != 200:
                raise ServerError.of(body)
            vector = [float(x) for x in body["data"][0]["embedding"]]
            prompt_tokens = int((body.get("usage") or {}).get("prompt_tokens") or len(row.tokens))
        except asyncio.CancelledError:
            self._on_cancelled(row.row_id)
            return
        except ServerError as error:
            self._on_failed(row.row_id, str(error), error.code)
            return
        except ServerDied as error:
            self._on_failed(row.row_id, f"llama.cpp's embedding server did not start: {error}", "engine_error")
            return
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as error:
            self._on_failed(
                row.row_id,
                f"llama.cpp's embedding server stopped answering: {type(error).__name__}: {error}",
                "engine_error",
            )
            return
        finally:
            self._rows.pop(row.row_id, None)
        self._on_embedded(row.row_id, vector, prompt_tokens)

    async def _running(self) -> httpx.AsyncClient:
        """The client of a running embedding server, started now if none runs: one start for the rows that wait
        on it together, which goes on though a row waiting on it is cancelled."""
        if self._server is None or self._server.exited:
            if self._starting is None or self._starting.done():
                self._starting = asyncio.get_running_loop().create_task(self._start())
            await asyncio.shield(self._starting)
        assert self._client is not None
        return self._client

    async def _start(self) -> None:
        await self._stop()
        server = LlamaServer(self.settings)
        try:
            await server.start(self._load_timeout_s)
        except BaseException:
            await server.stop()
            raise
        self._server = server
        self._client = server.client()

    async def _stop(self) -> None:
        client, server = self._client, self._server
        self._client = self._server = None
        if client is not None:
            await client.aclose()
        if server is not None:
            await server.stop()
