"""Downloading a model's files from the Hugging Face Hub (or `HF_ENDPOINT`) through huggingface_hub.

`list_remote_files` lists a repo with sizes and LFS hashes through `HfApi.model_info`, pinned to one commit.
`fetch_files` downloads the chosen files of that commit into a model directory, one at a time, each into
a partial file that survives the process (`resume.py`): huggingface_hub's `http_get` appends to it with a
Range request, so a download killed or cancelled mid-file continues from the bytes on disk in the next
process, and a connection dropped mid-file is resumed within the call. huggingface_hub also retries 429/5xx
itself (sleeping what `Retry-After` or the `RateLimit` headers ask). On top of that this module adds:

* progress: `http_get` instantiates `tqdm_class` for each file (with the bytes already there as `initial`)
  and calls `update(n)` per chunk (`DOWNLOAD_CHUNK_SIZE`). A tqdm subclass that never displays forwards
  those counts, so `on_progress(bytes_done, bytes_total)` advances within a file as well as at file
  boundaries, without a thread polling file sizes.
* cancellation: the same `update` raises `Cancelled` when the event is set, which aborts the stream
  between chunks; it is also checked between files and while hashing. Files already finished stay, and
  are listed in the manifest, so the next attempt skips them; the partial file of the file in flight stays
  too, and the next attempt resumes it.
* rate limits that survive huggingface_hub's own retries: waited out again, as `Retry-After` asks but
  never more than `max_rate_limit_wait_s` in total, then `RateLimited`.
* errors in words a user can act on: `AuthRequired` (401/403, gated repos: set `HF_TOKEN`),
  `NotFoundOnHub`, `HubUnreachable`, `OfflineUnavailable`.
* offline mode (`JETSHARD_OFFLINE=1` or `HF_HUB_OFFLINE=1`): no request is made at all.
* the manifest: once a file is whole, its size is checked against the listing, its sha256 computed (and
  compared with the Hub's LFS sha256 when the Hub gave one), it is fsynced and moved into place, and
  `.jetshard-manifest.json` is atomically rewritten to list every file now complete. The manifest never
  names a file that is not whole, so it can be written as files finish (a crash mid-model keeps the
  finished files' hashes).
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx2  # huggingface_hub's HTTP client: its connection errors are this library's
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from jetshard_schema.ids import ModelId, parse_model_id
from tqdm import tqdm

from jetshard_downloader.manifest import (
    Manifest,
    ManifestFile,
    read_manifest,
    remove_manifest,
    write_manifest,
)
from jetshard_downloader.paths import check_repo_filename, file_in
from jetshard_downloader.resume import (
    download_partial,
    drop_partial,
    partial_path,
    prepare_partial,
    sweep_partial_dir,
)

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
_HASH_CHUNK = 8 * 1024 * 1024
HUB_API_TIMEOUT_S = 20.0
"""A Hub that does not answer a listing within this is unreachable: its instance fails instead of waiting."""
_TRUE = {"1", "true", "yes", "on"}


class FetchError(Exception):
    """A download failed for a reason worth telling the user; `str()` is the message."""


class AuthRequired(FetchError):
    pass


class NotFoundOnHub(FetchError):
    pass


class HubUnreachable(FetchError):
    pass


class OfflineUnavailable(FetchError):
    pass


class RateLimited(FetchError):
    pass


class IntegrityError(FetchError):
    pass


class Cancelled(FetchError):
    pass


def is_offline(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(k, "").strip().lower() in _TRUE for k in ("JETSHARD_OFFLINE", "HF_HUB_OFFLINE"))


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    """None when the Hub did not say (listing without metadata)."""
    sha256: str | None = None
    """The LFS sha256 the Hub recorded, for LFS files; None for small git-stored files."""


@dataclass(frozen=True)
class RepoListing:
    model_id: ModelId
    revision: str
    """The commit sha the listing was taken at: download from it so all files are of one commit."""
    files: tuple[RemoteFile, ...]

    def select(self, names: Iterable[str]) -> tuple[RemoteFile, ...]:
        """The listed files named in `names` (ValueError naming any the repo lacks)."""
        wanted = set(names)
        by_name = {f.name: f for f in self.files}
        missing = wanted - by_name.keys()
        if missing:
            raise ValueError(f"{self.model_id}@{self.revision} has no files {sorted(missing)}")
        return tuple(by_name[n] for n in sorted(wanted))


def offline_error(model_id: str) -> OfflineUnavailable:
    return OfflineUnavailable(
        f"{model_id} is not available offline: it is not complete in any model directory and offline mode "
        "(JETSHARD_OFFLINE or HF_HUB_OFFLINE) forbids downloading it"
    )


def _translate(err: BaseException, model_id: str, revision: str | None, filename: str | None) -> FetchError:
    what = f"{model_id}/{filename}" if filename else model_id
    if isinstance(err, FetchError):
        return err
    if isinstance(err, GatedRepoError):
        return AuthRequired(
            f"{model_id} is gated: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
        )
    if isinstance(err, RepositoryNotFoundError):
        return NotFoundOnHub(
            f"{model_id} was not found on the Hub; if it is private or gated, set HF_TOKEN to a token that can read it"
        )
    if isinstance(err, RevisionNotFoundError):
        return NotFoundOnHub(f"{model_id} has no revision {revision!r}")
    if isinstance(err, RemoteEntryNotFoundError):
        return NotFoundOnHub(f"{what} was not found on the Hub at revision {revision!r}")
    if isinstance(err, OfflineModeIsEnabled):
        return offline_error(model_id)
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status in (401, 403):
            return AuthRequired(
                f"the Hub refused {what} (HTTP {status}): a token is needed; set HF_TOKEN to a token "
                "that can read this repo"
            )
        if status == 429:
            return RateLimited(f"the Hub kept rate-limiting requests for {what} (HTTP 429); try again later")
        return HubUnreachable(f"the Hub answered HTTP {status} for {what}: {err}")
    if isinstance(err, LocalEntryNotFoundError | ConnectionError | TimeoutError | httpx2.TransportError):
        return HubUnreachable(f"could not reach the Hub for {what}: {err}")
    return HubUnreachable(f"downloading {what} failed: {type(err).__name__}: {err}")


def _retry_after_s(err: HfHubHTTPError) -> float | None:
    if err.response is None:
        return None
    value = err.response.headers.get("Retry-After", "").strip()
    return float(value) if value.isdigit() else None


def _with_rate_limit_retries(call: Callable[[], Any], cancel: threading.Event, max_wait_s: float, what: str) -> Any:
    waited = 0.0
    backoff = 1.0
    while True:
        try:
            return call()
        except HfHubHTTPError as err:
            if err.response is None or err.response.status_code != 429:
                raise
            wait = _retry_after_s(err) or backoff
            backoff = min(backoff * 2, 60.0)
            if waited + wait > max_wait_s:
                raise RateLimited(
                    f"the Hub is rate-limiting {what} (HTTP 429) and asked to wait longer than the "
                    f"{max_wait_s:.0f} s allowed; try again later or set HF_TOKEN for a higher limit"
                ) from err
            log.warning("rate limited on %s; waiting %.0f s", what, wait)
            if cancel.wait(wait):
                raise Cancelled(f"download of {what} cancelled") from err
            waited += wait


def list_remote_files(
    model_id: ModelId | str,
    revision: str = "main",
    *,
    token: str | bool | None = None,
    endpoint: str | None = None,
    environ: Mapping[str, str] = os.environ,
    cancel: threading.Event | None = None,
    max_rate_limit_wait_s: float = 300.0,
) -> RepoListing:
    """The repo's files with sizes and LFS hashes, pinned to the commit `revision` resolves to."""
    model_id = parse_model_id(model_id)
    if is_offline(environ):
        raise offline_error(model_id)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = _with_rate_limit_retries(
            lambda: api.model_info(model_id, revision=revision, files_metadata=True, timeout=HUB_API_TIMEOUT_S),
            cancel or threading.Event(),
            max_rate_limit_wait_s,
            model_id,
        )
    except Exception as err:
        raise _translate(err, model_id, revision, None) from err
    files = []
    for sibling in info.siblings or ():
        try:
            name = check_repo_filename(sibling.rfilename)
        except ValueError:
            # A listing is remote input; a name that would escape the model directory is unusable.
            log.warning("ignoring unsafe file name %r in the listing of %s", sibling.rfilename, model_id)
            continue
        lfs = getattr(sibling, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        files.append(RemoteFile(name=name, size=sibling.size, sha256=sha))
    if not info.sha:
        raise HubUnreachable(f"the Hub did not say which commit {model_id}@{revision} is")
    return RepoListing(model_id=model_id, revision=info.sha, files=tuple(files))


class _Tally:
    """Byte counts of one fetch_files call, fed by the progress bars `http_get` creates."""

    def __init__(self, total: int, on_progress: ProgressCallback | None, cancel: threading.Event) -> None:
        self.done = 0
        self.in_file = 0
        self.total = total
        self.size_known = True
        self.on_progress = on_progress
        self.cancel = cancel

    def report(self) -> None:
        if self.on_progress is not None:
            done = self.done + self.in_file
            self.on_progress(done, max(self.total, done))

    def start_file(self, size_known: bool) -> None:
        self.in_file = 0
        self.size_known = size_known

    def bar_opened(self, total: int | None, initial: int) -> None:
        if not self.size_known and total:
            self.total += total
            self.size_known = True
        self.in_file = initial
        self.report()

    def advance(self, n: int) -> None:
        if self.cancel.is_set():
            raise Cancelled("download cancelled")
        self.in_file += n
        self.report()

    def finish_file(self, size: int) -> None:
        if not self.size_known:
            self.total += size
        self.in_file = 0
        self.done += size
        self.report()


class _ProgressBar(tqdm):  # type: ignore[type-arg]
    """Never displays; forwards `http_get`'s per-chunk updates to a _Tally (see module doc)."""

    tally: ClassVar[_Tally]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
        self.tally.bar_opened(kwargs.get("total"), int(kwargs.get("initial") or 0))

    def update(self, n: float | None = 1) -> bool | None:
        self.tally.advance(int(n or 0))
        return None


def _progress_class(tally: _Tally) -> type[_ProgressBar]:
    return type("_BoundProgressBar", (_ProgressBar,), {"tally": tally})


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    """Hex sha256 of a file; also fsyncs it, since this runs right before the manifest vouches for it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"hashing {path.name} cancelled")
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


_locks: weakref.WeakValueDictionary[Path, threading.Lock] = weakref.WeakValueDictionary()
_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    """A process-local lock for `path`, alive while someone holds it.

    Two shards of one model on one node may download into the same directory at the same time. The model
    directory's lock guards its manifest (re-read under it, so one's rewrite keeps the other's files) and
    the folders of `.jetshard-partial`; a partial file's lock makes a fetch wait while the other downloads
    that file (both need the support files). One downloader runs per node, so process-local locks suffice.
    """
    with _locks_guard:
        return _locks.setdefault(path.resolve(), threading.Lock())


def _record_file(target: Path, base: Manifest, entry: ManifestFile) -> Manifest:
    """Add `entry` to the manifest on disk, keeping entries other fetches into `target` added meanwhile.

    The caller holds `_lock_for(target)`.
    """
    current = read_manifest(target)
    if current is None or (current.model_id, current.revision) != (base.model_id, base.revision):
        current = base
    updated = current.merged(Manifest(model_id=base.model_id, revision=base.revision, files=(entry,)))
    write_manifest(target, updated)
    return updated


def _listed_size(target: Path, manifest: Manifest, remote: RemoteFile) -> int | None:
    """The size of `remote` if `manifest` lists it with the Hub's size and it is that size on disk."""
    size = manifest.sizes().get(remote.name)
    if size is None or (remote.size is not None and size != remote.size):
        return None
    try:
        return size if file_in(target, remote.name).stat().st_size == size else None
    except OSError:
        return None


def _download_whole(
    download: Callable[[], None],
    target: Path,
    partial: Path,
    revision: str,
    remote: RemoteFile,
    cancel: threading.Event,
    max_rate_limit_wait_s: float,
    what: str,
) -> ManifestFile:
    """Complete `partial` with `download` and check it against the listing; the entry it earns."""
    with _lock_for(target):
        prepare_partial(partial, revision, remote.size, remote.sha256)
    _with_rate_limit_retries(download, cancel, max_rate_limit_wait_s, what)
    size = partial.stat().st_size
    if remote.size is not None and size != remote.size:
        partial.unlink(missing_ok=True)
        raise IntegrityError(f"{what} is {size} bytes on disk, the Hub says {remote.size}")
    digest = sha256_file(partial, cancel)
    if remote.sha256 is not None and digest != remote.sha256.lower():
        with _lock_for(target):
            drop_partial(partial, target)
        raise IntegrityError(
            f"{what} has sha256 {digest}, the Hub says {remote.sha256}; "
            "the partial file was deleted, retry the download"
        )
    return ManifestFile(remote.name, size, digest)


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
        raise offline_error(model_id)
    buffer = io.BytesIO()
    url = hf_hub_url(model_id, name, revision=revision, endpoint=endpoint)
    try:
        http_get(url, buffer, headers=build_hf_headers(token=token), expected_size=size, displayed_filename=name)
    except Exception as err:
        raise _translate(err, model_id, revision, name) from err
    return buffer.getvalue()


def fetch_files(
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
    """Download `files` of `model_id` at `revision` (a commit sha, from `list_remote_files`) into `target`.

    `target` is the model directory itself (`Choice.model_dir`). Files a manifest of the same revision
    already lists with the right size are skipped; the others are downloaded, continuing any partial file
    an earlier attempt left (see module doc). Returns the manifest as written: the files of this call plus
    those already listed.
    Raises FetchError subclasses (see module doc); ValueError for invalid ids or file names.
    """
    model_id = parse_model_id(model_id)
    names = [check_repo_filename(f.name) for f in files]
    if len(set(names)) != len(names):
        raise ValueError("fetch_files got the same file twice")
    if is_offline(environ):
        raise offline_error(model_id)
    cancel = cancel or threading.Event()

    target.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(target)
    if existing is not None and (existing.model_id, existing.revision) != (model_id, revision):
        # The listed files may be replaced by another commit's version below; never let a manifest vouch
        # for a mix of commits.
        remove_manifest(target)
        existing = None
    manifest = existing or Manifest(model_id=model_id, revision=revision, files=())

    tally = _Tally(sum(f.size or 0 for f in files), on_progress, cancel)
    bar_class = _progress_class(tally)
    headers = build_hf_headers(token=token)
    tally.report()

    for remote in files:
        if cancel.is_set():
            raise Cancelled(f"download of {model_id} cancelled")
        tally.start_file(size_known=remote.size is not None)
        partial = partial_path(target, remote.name)
        with _lock_for(partial):
            # Another fetch into `target` may have finished this file while this one waited for the lock.
            current = read_manifest(target)
            if current is not None and (current.model_id, current.revision) == (model_id, revision):
                manifest = current
            size = _listed_size(target, manifest, remote)
            if size is None:
                url = hf_hub_url(model_id, remote.name, revision=revision, endpoint=endpoint)
                download = functools.partial(
                    download_partial, url, headers, partial, remote.name, remote.size, bar_class
                )
                try:
                    entry = _download_whole(
                        download,
                        target,
                        partial,
                        revision,
                        remote,
                        cancel,
                        max_rate_limit_wait_s,
                        f"{model_id}/{remote.name}",
                    )
                except Exception as err:
                    raise _translate(err, model_id, revision, remote.name) from err
                with _lock_for(target):
                    path = file_in(target, remote.name)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(partial, path)
                    drop_partial(partial, target)
                    manifest = _record_file(target, manifest, entry)
                size = entry.size
        tally.finish_file(size)

    with _lock_for(target):
        sweep_partial_dir(target)
    return manifest
