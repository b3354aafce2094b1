"""Fetching a custom model card from the Hugging Face Hub (or `HF_ENDPOINT`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from jetshard_schema.card_from_config import UnsupportedModelError, card_from_hub_metadata
from jetshard_schema.cards import ModelCard
from jetshard_schema.ids import ModelId

from jetshard_api.errors import ApiError

INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Connection refused, DNS failures and timeouts surface as the HTTP library's own errors: `OSError`s with
# requests, but neither `OSError` nor `HfHubHTTPError` with httpx (huggingface_hub >= 1) or its httpx2 fork.
# The library's base error is the `HTTPError` that `HfHubHTTPError` itself derives from.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    *(cls for cls in HfHubHTTPError.__mro__[1:] if cls.__name__ == "HTTPError"),
    OSError,
)


def offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
        for name in ("JETSHARD_OFFLINE", "HF_HUB_OFFLINE")
    )


def fetch_card(model_id: ModelId) -> ModelCard:
    """Build a custom card from the repo's config.json, safetensors index, generation and tokenizer configs.
    Blocking: run in a thread."""
    if offline():
        raise ApiError(
            503,
            "offline: adding a model needs the Hugging Face Hub (unset JETSHARD_OFFLINE / HF_HUB_OFFLINE)",
            "offline",
        )
    api = HfApi()
    try:
        info = api.model_info(model_id, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        if "config.json" not in sizes:
            raise ApiError(
                400, f"{model_id} has no config.json; jetshard serves transformers-style MLX models", "no_config"
            )
        with tempfile.TemporaryDirectory() as scratch:
            config = _read_json(model_id, "config.json", info.sha, scratch)
            index = _read_json(model_id, INDEX_FILE, info.sha, scratch) if INDEX_FILE in sizes else None
            generation = None
            if GENERATION_CONFIG_FILE in sizes:
                # Optional: sampling defaults only; a broken one must not keep the model out (the runner
                # ignores it too).
                with contextlib.suppress(ApiError):
                    generation = _read_json(model_id, GENERATION_CONFIG_FILE, info.sha, scratch)
            tokenizer_config = None
            if TOKENIZER_CONFIG_FILE in sizes:
                # Optional too: it only says whether the model thinks (its added tokens).
                with contextlib.suppress(ApiError):
                    tokenizer_config = _read_json(model_id, TOKENIZER_CONFIG_FILE, info.sha, scratch)
    except GatedRepoError as error:
        raise ApiError(
            403, f"{model_id} is gated or private: accept its terms on the Hub and set HF_TOKEN", "gated_repo"
        ) from error
    except RepositoryNotFoundError as error:
        raise ApiError(
            404, f"{model_id} was not found on the Hub (or is private and HF_TOKEN is not set)", "model_not_found"
        ) from error
    except LocalEntryNotFoundError as error:  # a download that could not reach the Hub at all
        raise ApiError(502, f"the Hub is unreachable: {error}", "hub_unreachable") from error
    except EntryNotFoundError as error:
        raise ApiError(400, f"{model_id}: {error}", "no_config") from error
    except HfHubHTTPError as error:
        raise ApiError(502, f"the Hub answered with an error for {model_id}: {error}", "hub_error") from error
    except _TRANSPORT_ERRORS as error:  # connection refused, DNS, timeouts
        raise ApiError(502, f"the Hub is unreachable: {error}", "hub_unreachable") from error
    try:
        return card_from_hub_metadata(model_id, config, index, sizes, generation, tokenizer_config)
    except UnsupportedModelError as error:
        raise ApiError(400, str(error), "unsupported_model") from error
    except ValueError as error:  # a config.json that lacks or garbles a required value
        raise ApiError(400, str(error), "invalid_config") from error


def _read_json(model_id: ModelId, filename: str, revision: str | None, scratch: str) -> dict:  # type: ignore[type-arg]
    path = hf_hub_download(model_id, filename, revision=revision, local_dir=scratch)
    try:
        with open(path, encoding="utf-8") as file:
            result: dict = json.load(file)  # type: ignore[type-arg]
    except ValueError as error:  # not JSON, or not UTF-8: the repo's fault, not a server error
        raise ApiError(400, f"{model_id}: {filename} is not valid JSON: {error}", "invalid_config") from error
    return result
