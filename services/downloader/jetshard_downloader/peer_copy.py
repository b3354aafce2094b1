"""Copying a model's files from another node's file server (`file_server`) instead of the Hub: blocking, run in a
thread as `fetch.fetch_files` is, with the same bookkeeping.

* What to copy: the source's manifest (`fetch_manifest`) lists its files with their sizes and sha256 and the Hub
  commit they came from; the caller picks the files its layer range or form needs from it.
* Integrity: each file is hashed as it arrives (a resumed one: its part on disk first) and must match the sha256
  the source's manifest records, and the Hub's where the card has one (a Hub GGUF card's); a mismatch deletes the
  partial file and fails this source
  (`IntegrityError`): the caller goes on to the next source, then the Hub. A source cannot vouch for bytes other than
  those its manifest recorded when it verified them.
* Resuming: bytes go to the same partial file a Hub download would use (`resume.partial_path`, its record naming
  the commit, size and sha256), appended to with `Range: bytes=<bytes there>-`; a copy interrupted (the downloader
  killed, a cancel, a dropped connection) continues from the bytes on disk, from this node or the Hub alike, since
  both are the one commit's bytes.
* The manifest of the target directory is written as files finish (`fetch._record_file`), naming the source's
  commit, so `locate` sees the model complete exactly when its files are.
* Cancellation is checked between reads (1 MiB); each read waits at most `READ_TIMEOUT_S`.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

import msgspec
from jetshard_schema.ids import ModelId

from jetshard_downloader.fetch import (
    Cancelled,
    FetchError,
    IntegrityError,
    ProgressCallback,
    RemoteFile,
    _listed_size,
    _lock_for,
    _record_file,
)
from jetshard_downloader.manifest import Manifest, ManifestFile, read_manifest, remove_manifest
from jetshard_downloader.paths import check_repo_filename, file_in
from jetshard_downloader.peers import PeerSource
from jetshard_downloader.resume import drop_partial, partial_path, prepare_partial, sweep_partial_dir

READ_SIZE = 1024 * 1024
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024


class PeerUnavailable(FetchError):
    """The source could not be reached, refused, or does not have the model (any more)."""


class PeerUnreachable(PeerUnavailable):
    """No HTTP answer came: the source is down, or its server does not admit this session's certificate (yet: it
    learns a new session's certificate from State a moment after this node reported it)."""


def _base(model_id: ModelId) -> str:
    org, name = model_id.split("/", 1)
    return f"/v1/models/{quote(org, safe='')}/{quote(name, safe='')}"


def _get(
    source: PeerSource, context: ssl.SSLContext, path: str, start: int = 0
) -> tuple[http.client.HTTPSConnection, http.client.HTTPResponse]:
    connection = http.client.HTTPSConnection(source.host, source.port, context=context, timeout=CONNECT_TIMEOUT_S)
    headers = {"Range": f"bytes={start}-"} if start else {}
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
    except (OSError, http.client.HTTPException) as error:
        connection.close()
        raise PeerUnreachable(f"node {source.node_id} ({source.host}:{source.port}): {error}") from error
    if connection.sock is not None:
        connection.sock.settimeout(READ_TIMEOUT_S)
    if response.status not in (200, 206):
        detail = response.read(4096).decode("utf-8", "replace")
        connection.close()
        raise PeerUnavailable(f"node {source.node_id} answered {response.status}: {detail}")
    return connection, response


def fetch_manifest(source: PeerSource, context: ssl.SSLContext, model_id: ModelId) -> Manifest:
    """The manifest of `model_id` on `source`; PeerUnavailable when it has none to give."""
    connection, response = _get(source, context, f"{_base(model_id)}/manifest")
    try:
        data = response.read(MAX_MANIFEST_BYTES + 1)
    except (OSError, http.client.HTTPException) as error:
        raise PeerUnavailable(f"node {source.node_id}: {error}") from error
    finally:
        connection.close()
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
        for entry in manifest.files:
            check_repo_filename(entry.name)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
        raise PeerUnavailable(f"node {source.node_id} sent an unusable manifest of {model_id}: {error}") from error
    if manifest.model_id != model_id:
        raise PeerUnavailable(f"node {source.node_id} sent the manifest of {manifest.model_id}, not {model_id}")
    return manifest


def fetch_small_json(source: PeerSource, context: ssl.SSLContext, model_id: ModelId, entry: ManifestFile) -> object:
    """A small file of the source's (the safetensors index), checked against its manifest entry, parsed as JSON."""
    if entry.size > MAX_SMALL_FILE_BYTES:
        raise PeerUnavailable(f"{entry.name} of {model_id} is too large to read into memory ({entry.size} bytes)")
    connection, response = _get(source, context, f"{_base(model_id)}/files/{quote(entry.name)}")
    try:
        data = response.read(entry.size + 1)
    except (OSError, http.client.HTTPException) as error:
        raise PeerUnavailable(f"node {source.node_id}: {error}") from error
    finally:
        connection.close()
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256.lower():
        raise IntegrityError(f"{model_id}/{entry.name} from node {source.node_id} is not what its manifest says")
    try:
        return json.loads(data)
    except ValueError as error:
        raise PeerUnavailable(f"{model_id}/{entry.name} from node {source.node_id} is not JSON") from error


def _append(
    source: PeerSource,
    context: ssl.SSLContext,
    model_id: ModelId,
    partial: Path,
    entry: ManifestFile,
    on_bytes: ProgressCallback,
    cancel: threading.Event,
) -> str:
    """Append to `partial` the bytes of the source's file it still lacks, then fsync it; the sha256 of the whole
    file, hashed as the bytes arrive (after the part already there, on a resumed copy): reading a file of gigabytes
    again to hash it would add a tenth to a copy over 1 Gbit/s (bench/node_copy.py)."""
    digest = hashlib.sha256()
    with open(partial, "ab") as f:
        have = f.tell()
        if have > entry.size:
            f.truncate(0)
            have = 0
        if have:
            _hash_into(digest, partial, have, cancel)
        on_bytes(have, entry.size)
        if have == entry.size:
            return digest.hexdigest()
        connection, response = _get(source, context, f"{_base(model_id)}/files/{quote(entry.name)}", have)
        try:
            if have and response.status != 206:  # a server that ignored the range sends it all: start over
                f.truncate(0)
                have = 0
                digest = hashlib.sha256()
            while have < entry.size:
                if cancel.is_set():
                    raise Cancelled(f"copy of {model_id} cancelled")
                try:
                    chunk = response.read(min(READ_SIZE, entry.size - have))
                except (OSError, http.client.HTTPException) as error:
                    raise PeerUnavailable(f"node {source.node_id} stopped sending {entry.name}: {error}") from error
                if not chunk:
                    raise PeerUnavailable(f"node {source.node_id} ended {entry.name} at byte {have} of {entry.size}")
                f.write(chunk)
                digest.update(chunk)
                have += len(chunk)
                on_bytes(have, entry.size)
        finally:
            connection.close()
            f.flush()
            os.fsync(f.fileno())
    return digest.hexdigest()


def _hash_into(digest: hashlib._Hash, path: Path, size: int, cancel: threading.Event) -> None:
    """Feed the first `size` bytes of `path` to `digest`."""
    with open(path, "rb") as f:
        left = size
        while left:
            if cancel.is_set():
                raise Cancelled(f"hashing {path.name} cancelled")
            block = f.read(min(READ_SIZE, left))
            if not block:
                raise OSError(f"{path} ended before byte {size}")
            digest.update(block)
            left -= len(block)


def copy_files(
    source: PeerSource,
    context: ssl.SSLContext,
    manifest: Manifest,
    target: Path,
    names: Sequence[str],
    *,
    expected_sha256: Mapping[str, str] | None = None,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Manifest:
    """Copy the files `names` of the source's `manifest` into the model directory `target` (see module doc); the
    manifest as written there. `expected_sha256`: hashes the Hub recorded for some of them, checked as well."""
    model_id = ModelId(manifest.model_id)
    cancel = cancel or threading.Event()
    by_name = {entry.name: entry for entry in manifest.files}
    entries = [by_name[check_repo_filename(name)] for name in names]
    for name, sha in (expected_sha256 or {}).items():
        if name in by_name and sha and by_name[name].sha256.lower() != sha.lower():
            raise IntegrityError(
                f"node {source.node_id}'s {model_id}/{name} has sha256 {by_name[name].sha256}, the Hub's is {sha}"
            )
    target.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(target)
    if existing is not None and (existing.model_id, existing.revision) != (manifest.model_id, manifest.revision):
        remove_manifest(target)  # never let a manifest vouch for a mix of commits
        existing = None
    written = existing or Manifest(model_id=manifest.model_id, revision=manifest.revision, files=())
    total = sum(entry.size for entry in entries)
    done = 0

    def report(in_file: int, _size: int) -> None:
        if on_progress is not None:
            on_progress(done + in_file, total)

    for entry in entries:
        if cancel.is_set():
            raise Cancelled(f"copy of {model_id} cancelled")
        partial = partial_path(target, entry.name)
        remote = RemoteFile(entry.name, entry.size, entry.sha256)
        with _lock_for(partial):
            current = read_manifest(target)
            if current is not None and (current.model_id, current.revision) == (manifest.model_id, manifest.revision):
                written = current
            if _listed_size(target, written, remote) is None:
                with _lock_for(target):
                    prepare_partial(partial, manifest.revision, entry.size, entry.sha256)
                digest = _append(source, context, model_id, partial, entry, report, cancel)
                if digest != entry.sha256.lower():
                    with _lock_for(target):
                        drop_partial(partial, target)
                    raise IntegrityError(
                        f"{model_id}/{entry.name} copied from node {source.node_id} has sha256 {digest}, its manifest "
                        f"says {entry.sha256}: the source's copy is damaged; the partial file was deleted"
                    )
                with _lock_for(target):
                    path = file_in(target, entry.name)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(partial, path)
                    drop_partial(partial, target)
                    written = _record_file(target, written, ManifestFile(entry.name, entry.size, digest))
        done += entry.size
        report(0, 0)
    with _lock_for(target):
        sweep_partial_dir(target)
    return written
