"""Downloads that survive the downloader being killed: a persistent partial file per repo file, resumed with
an HTTP Range request through huggingface_hub's own `http_get`.

`fetch.fetch_files` goes through `hf_hub_download`, which (huggingface_hub >= 1.x) streams into a
process-unique temporary file and deletes it when the download fails: a download resumes within one call,
never across processes. This module keeps the rest of `fetch.py`'s contract (progress through a tqdm class,
cancellation between chunks, rate-limit waits, error translation, sha256 check against the Hub's LFS hash,
the manifest rewritten after every file) and changes only the transport of one file:

* bytes go to `<model dir>/.jetshard-partial/<name>.incomplete` (opened for appending), next to a small
  `<name>.incomplete.json` naming the revision, size and sha256 the bytes belong to; a partial file of
  another revision or size is discarded, never continued;
* `huggingface_hub.file_download.http_get(url, file, resume_size=<bytes already there>,
  expected_size=<size from the listing>)` sends `Range: bytes=<resume_size>-` and appends the rest (it also
  copes with a server that ignores the Range by rewinding and truncating), with huggingface_hub's retries,
  headers, redirects and error types;
* once whole, the file is fsynced, hashed, moved into place, and only then listed in the manifest.

`.jetshard-partial` is a name no repo file can take (`paths.check_repo_filename` reserves `.jetshard*`), and
its bytes count as "this model is partly here" for `choose_directory`, so a restarted download picks the
same directory again. huggingface_hub writes chunks of `DOWNLOAD_CHUNK_SIZE` (10 MiB by default, buffered in
memory until complete); `RESUME_CHUNK_SIZE` lowers it in this process so a kill loses at most that much.

Xet: files are fetched with plain HTTP from the `resolve` URL, which the Hub serves for Xet-backed files too
(with Range support). That gives up Xet's chunk deduplication in exchange for resuming across restarts.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from jetshard_schema.ids import ModelId, parse_model_id

from jetshard_downloader.fetch import (
    Cancelled,
    IntegrityError,
    ProgressCallback,
    RemoteFile,
    _offline_error,
    _progress_class,
    _record_file,
    _Tally,
    _translate,
    _with_rate_limit_retries,
    is_offline,
    sha256_file,
)
from jetshard_downloader.manifest import Manifest, ManifestFile, read_manifest, remove_manifest
from jetshard_downloader.paths import check_repo_filename, file_in

log = logging.getLogger(__name__)

PARTIAL_DIR = ".jetshard-partial"
RESUME_CHUNK_SIZE = 1024 * 1024
"""Bytes huggingface_hub buffers before writing; what a kill -9 can lose of the file in flight."""


def use_small_download_chunks(chunk_size: int = RESUME_CHUNK_SIZE) -> None:
    """Make huggingface_hub write every `chunk_size` bytes (it reads the constant at each call)."""
    if hf_constants.DOWNLOAD_CHUNK_SIZE > chunk_size:
        hf_constants.DOWNLOAD_CHUNK_SIZE = chunk_size


def partial_path(target: Path, name: str) -> Path:
    """Where the unfinished bytes of repo file `name` are kept inside model directory `target`."""
    check_repo_filename(name)
    return target.joinpath(PARTIAL_DIR, *f"{name}.incomplete".split("/"))


def _meta_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".json")


def _prepare_partial(partial: Path, revision: str, remote: RemoteFile) -> None:
    """Keep `partial` only if it belongs to this revision and size; record what it belongs to."""
    meta = _meta_path(partial)
    wanted = {"revision": revision, "size": remote.size, "sha256": remote.sha256}
    try:
        known = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = None
    if known != wanted or (remote.size is None):
        partial.unlink(missing_ok=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if known != wanted:
        meta.write_text(json.dumps(wanted), encoding="utf-8")


def _drop_partial(partial: Path, target: Path) -> None:
    partial.unlink(missing_ok=True)
    _meta_path(partial).unlink(missing_ok=True)
    # Remove now-empty folders up to and including .jetshard-partial.
    root = target / PARTIAL_DIR
    folder = partial.parent
    while folder != root.parent and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except OSError:
            break
        folder = folder.parent


def _download_one(url: str, headers: dict[str, str], partial: Path, remote: RemoteFile,
                  bar_class: type) -> None:
    with open(partial, "ab") as f:
        resume = f.tell()
        if remote.size is not None and resume > remote.size:
            f.truncate(0)
            resume = 0
        if resume:
            log.info("resuming %s at byte %d of %s", remote.name, resume, remote.size)
        http_get(url, f, resume_size=resume, headers=headers, expected_size=remote.size,
                 displayed_filename=remote.name, tqdm_class=bar_class)
        f.flush()
        os.fsync(f.fileno())


def fetch_bytes(
    model_id: ModelId | str,
    revision: str,
    name: str,
    *,
    size: int | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> bytes:
    """A small repo file (the safetensors index) read into memory, without touching any model directory."""
    model_id = parse_model_id(model_id)
    check_repo_filename(name)
    if is_offline(environ):
        raise _offline_error(model_id)
    buffer = io.BytesIO()
    url = hf_hub_url(model_id, name, revision=revision, endpoint=endpoint)
    try:
        http_get(url, buffer, headers=build_hf_headers(token=token), expected_size=size,
                 displayed_filename=name)
    except Exception as err:
        raise _translate(err, model_id, revision, name) from err
    return buffer.getvalue()


def fetch_files_resumable(
    model_id: ModelId | str,
    revision: str,
    target: Path,
    files: Sequence[RemoteFile],
    *,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    environ: Mapping[str, str] = os.environ,
    max_rate_limit_wait_s: float = 300.0,
) -> Manifest:
    """`fetch.fetch_files` with partial files kept and resumed across processes (see module doc)."""
    model_id = parse_model_id(model_id)
    names = [check_repo_filename(f.name) for f in files]
    if len(set(names)) != len(names):
        raise ValueError("fetch_files_resumable got the same file twice")
    if is_offline(environ):
        raise _offline_error(model_id)
    cancel = cancel or threading.Event()

    target.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(target)
    if existing is not None and (existing.model_id, existing.revision) != (model_id, revision):
        remove_manifest(target)
        existing = None
    manifest = existing or Manifest(model_id=model_id, revision=revision, files=())
    listed = manifest.sizes()

    tally = _Tally(sum(f.size or 0 for f in files), on_progress, cancel)
    bar_class = _progress_class(tally)
    headers = build_hf_headers(token=token)
    tally.report()

    for remote in files:
        if cancel.is_set():
            raise Cancelled(f"download of {model_id} cancelled")
        path = file_in(target, remote.name)
        if remote.name in listed and (remote.size is None or listed[remote.name] == remote.size):
            try:
                if path.stat().st_size == listed[remote.name]:
                    tally.start_file(size_known=remote.size is not None)
                    tally.finish_file(listed[remote.name])
                    continue
            except OSError:
                pass
        tally.start_file(size_known=remote.size is not None)
        partial = partial_path(target, remote.name)
        url = hf_hub_url(model_id, remote.name, revision=revision, endpoint=endpoint)
        try:
            _prepare_partial(partial, revision, remote)
            _with_rate_limit_retries(
                functools.partial(_download_one, url, headers, partial, remote, bar_class),
                cancel, max_rate_limit_wait_s, f"{model_id}/{remote.name}",
            )
            size = partial.stat().st_size
            if remote.size is not None and size != remote.size:
                partial.unlink(missing_ok=True)
                raise IntegrityError(
                    f"{model_id}/{remote.name} is {size} bytes on disk, the Hub says {remote.size}"
                )
            digest = sha256_file(partial, cancel)
        except Exception as err:
            raise _translate(err, model_id, revision, remote.name) from err
        if remote.sha256 is not None and digest != remote.sha256.lower():
            _drop_partial(partial, target)
            raise IntegrityError(
                f"{model_id}/{remote.name} has sha256 {digest}, the Hub says {remote.sha256}; "
                "the partial file was deleted, retry the download"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, path)
        _drop_partial(partial, target)
        manifest = _record_file(target, manifest, ManifestFile(remote.name, size, digest))
        tally.finish_file(size)

    leftover = target / PARTIAL_DIR
    if leftover.is_dir() and not any(leftover.rglob("*.incomplete")):
        shutil.rmtree(leftover, ignore_errors=True)
    return manifest
