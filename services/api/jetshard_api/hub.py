"""Fetching a custom model card from the Hugging Face Hub (or `HF_ENDPOINT`): a transformers-style repo's from its
config files, a GGUF file's from its header, read with HTTP Range requests (never the tensors)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator

from huggingface_hub import HfApi, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from jetshard_schema.card_from_config import UnsupportedModelError, card_from_hub_metadata
from jetshard_schema.cards import ModelCard, ModelSource
from jetshard_schema.gguf_card import (
    PROJECTOR_ARCHITECTURE,
    HubGgufRef,
    UnsupportedGguf,
    card_from_gguf,
    check_hub_gguf_file,
    split_count,
    split_part_names,
)
from jetshard_schema.gguf_header import MAX_HEADER_BYTES, GgufHeader, NeedMoreBytes, parse_gguf_header
from jetshard_schema.ids import ModelId

from jetshard_api.errors import ApiError, refused_as_bad_request

INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GGUF_FIRST_READ_BYTES = 1 << 20
"""The first Range request of a GGUF's header: all of it for most models; one with a large vocabulary (150,000
tokens and their merges: some 6 MiB) takes a few more, each asking at least twice as much."""
HUB_READ_TIMEOUT_S = 30.0

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


def _check_online() -> None:
    if offline():
        raise ApiError(
            503,
            "offline: adding a model needs the Hugging Face Hub (unset JETSHARD_OFFLINE / HF_HUB_OFFLINE)",
            "offline",
        )


@contextlib.contextmanager
def _hub_errors(repo: str, *, missing_entry: tuple[int, str]) -> Iterator[None]:
    """The Hub's errors for `repo` as the API's: a gated repo 403, a missing one 404, a missing file
    `missing_entry` (status, code), an unreachable Hub 502."""
    try:
        yield
    except GatedRepoError as error:
        raise ApiError(
            403, f"{repo} is gated or private: accept its terms on the Hub and set HF_TOKEN", "gated_repo"
        ) from error
    except RepositoryNotFoundError as error:
        raise ApiError(
            404, f"{repo} was not found on the Hub (or is private and HF_TOKEN is not set)", "model_not_found"
        ) from error
    except LocalEntryNotFoundError as error:  # a download that could not reach the Hub at all
        raise ApiError(502, f"the Hub is unreachable: {error}", "hub_unreachable") from error
    except EntryNotFoundError as error:
        raise ApiError(missing_entry[0], f"{repo}: {error}", missing_entry[1]) from error
    except HfHubHTTPError as error:
        raise ApiError(502, f"the Hub answered with an error for {repo}: {error}", "hub_error") from error
    except _TRANSPORT_ERRORS as error:  # connection refused, DNS, timeouts
        raise ApiError(502, f"the Hub is unreachable: {error}", "hub_unreachable") from error


def fetch_card(model_id: ModelId) -> ModelCard:
    """Build a custom card from the repo's config.json, safetensors index, generation and tokenizer configs.
    Blocking: run in a thread."""
    _check_online()
    api = HfApi()
    with _hub_errors(model_id, missing_entry=(400, "no_config")):
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


def fetch_gguf_card(model_id: ModelId, ref: HubGgufRef) -> ModelCard:
    """Build a custom card from the header of the GGUF file `ref` names (its first part, for a split model) and
    the sizes of all its files, read from the repo's listing; the projector's header is checked too. Blocking:
    run in a thread."""
    _check_online()
    with _hub_errors(ref.repo, missing_entry=(404, "file_not_found")):
        info = HfApi().model_info(ref.repo, files_metadata=True)
        revision = info.sha or "main"
        siblings = {s.rfilename: s for s in info.siblings or []}

        def listed(name: str, param: str) -> int:
            """The size of repo file `name`, or a 404 naming the GGUF files the repo has."""
            sibling = siblings.get(name)
            if sibling is None or sibling.size is None:
                ggufs = sorted(n for n in siblings if n.lower().endswith(".gguf"))
                has = f"its GGUF files: {', '.join(ggufs[:20])}" if ggufs else "it has no GGUF files"
                raise ApiError(404, f"{ref.repo} has no file {name!r}; {has}", "file_not_found", param)
            return sibling.size

        size = listed(ref.file, "gguf_file")
        header = _read_gguf_header(ref.repo, ref.file, revision, size, "gguf_file")
        sizes = [size]
        count = split_count(header)
        if count > 1:
            try:
                parts = split_part_names(ref.file, count)
            except UnsupportedGguf as error:
                raise ApiError(400, f"{ref.repo}/{ref.file}: {error}", "invalid_gguf", "gguf_file") from error
            missing = [part for part in parts if part not in siblings]
            if missing:
                raise ApiError(
                    400,
                    f"{ref.repo}/{ref.file} is part 1 of a model split into {count} files; the repo lacks "
                    + ", ".join(missing),
                    "invalid_gguf",
                    "gguf_file",
                )
            sizes += [listed(part, "gguf_file") for part in parts[1:]]
        if ref.mmproj:
            mmproj_size = listed(ref.mmproj, "mmproj_file")
            projector = _read_gguf_header(ref.repo, ref.mmproj, revision, mmproj_size, "mmproj_file")
            architecture = projector.text("general.architecture")
            if architecture != PROJECTOR_ARCHITECTURE:
                raise ApiError(
                    400,
                    f"{ref.repo}/{ref.mmproj} is not a projector (mmproj) file: its general.architecture is "
                    f"{architecture!r}, not {PROJECTOR_ARCHITECTURE!r}",
                    "invalid_gguf",
                    "mmproj_file",
                )
            sizes.append(mmproj_size)
    lfs = siblings[ref.file].lfs
    try:
        return card_from_gguf(
            model_id,
            header,
            file_sizes_bytes=sizes,
            source=ModelSource.HUB_GGUF,
            source_ref=str(ref),
            source_sha256=(lfs.sha256 if lfs is not None else "").lower(),
            has_mmproj=bool(ref.mmproj),
        )
    except UnsupportedGguf as error:
        raise ApiError(400, f"{ref.repo}/{ref.file} cannot be added: {error}", "unsupported_model") from error


def checked_gguf_file(name: str, param: str) -> str:
    """`name` as a GGUF file's path in its repo, or a 400 naming `param`."""
    with refused_as_bad_request("invalid_request_error", param):
        return check_hub_gguf_file(name)


def _read_gguf_header(repo: ModelId, filename: str, revision: str, size: int, param: str) -> GgufHeader:
    """The header of the repo's GGUF file of `size` bytes, read with Range requests that grow until they hold it
    all; a 400 naming the file when it is not a GGUF file llama.cpp reads or its header is beyond bounds."""
    url = hf_hub_url(repo, filename, revision=revision)
    data = bytearray()
    wanted = min(GGUF_FIRST_READ_BYTES, size)
    while True:
        chunk = _read_range(url, len(data), wanted)
        if not chunk:
            raise ApiError(502, f"the Hub sent no bytes of {repo}/{filename} from byte {len(data)}", "hub_error")
        data += chunk
        try:
            return parse_gguf_header(bytes(data), size)
        except NeedMoreBytes as more:
            if more.size > MAX_HEADER_BYTES:
                raise ApiError(
                    400,
                    f"{repo}/{filename}: its GGUF header is longer than {MAX_HEADER_BYTES >> 20} MiB "
                    f"(it runs past byte {more.size}); no model llama.cpp loads has one that long",
                    "invalid_gguf",
                    param,
                ) from None
            wanted = min(max(more.size, 2 * len(data)), size, MAX_HEADER_BYTES)
        except ValueError as error:
            raise ApiError(
                400, f"{repo}/{filename} is not a GGUF file llama.cpp reads: {error}", "invalid_gguf", param
            ) from error


def _read_range(url: str, start: int, end: int) -> bytes:
    """Bytes `[start, end)` of the file at `url` (fewer where it ends first), with the token and endpoint
    huggingface_hub uses. A server that ignores the Range sends the file from its start: the bytes before `start`
    are skipped and the stream is closed once `end` is reached, so no more than that is read either way."""
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
    kept = bytearray()
    with get_session().stream("GET", url, headers=headers, timeout=HUB_READ_TIMEOUT_S) as response:
        if response.status_code >= 400:
            response.read()  # the error's body (the Hub's message) for the error raised next
        hf_raise_for_status(response)
        offset = start if response.status_code == 206 else 0
        for piece in response.iter_bytes():
            skip = max(0, start - offset)
            offset += len(piece)
            kept += piece[skip : len(piece) - max(0, offset - end)]
            if offset >= end:
                break
    return bytes(kept)
