"""Downloading a model's files from the Hugging Face Hub (or `HF_ENDPOINT`) through huggingface_hub.

Transport, resume and verification are huggingface_hub's: `hf_hub_download(local_dir=...)` HEADs each file
for its etag and size, streams it into a temporary file and renames it into place, checks the size, and
retries a few times on transient errors (resuming the stream with a Range request within the call). It
also retries 429/5xx itself (up to 5 times, sleeping what `Retry-After` or the `RateLimit` headers ask).
On top of that this module adds:

* progress: huggingface_hub instantiates `tqdm_class` for each file and calls `update(n)` per chunk
  (10 MiB for plain HTTP; for Xet storage, per flushed block). A tqdm subclass that never displays
  forwards those counts, so `on_progress(bytes_done, bytes_total)` advances within a file as well as
  at file boundaries, without a thread polling file sizes.
* cancellation: the same `update` raises `Cancelled` when the event is set, which aborts the stream
  between chunks; it is also checked between files and while hashing. Files already finished stay, and
  are listed in the manifest, so the next attempt skips them. The partial file of the file in flight is
  not kept: huggingface_hub >= 1.x downloads into a process-unique temporary file and deletes it when the
  download fails (it resumes within one call, not across calls), so a cancel loses at most one file's
  progress. (Xet downloads run their callback from native code; if an exception cannot stop them there,
  the file finishes and the cancel takes effect at the file boundary.)
* rate limits that survive huggingface_hub's own retries: waited out again, as `Retry-After` asks but
  never more than `max_rate_limit_wait_s` in total, then `RateLimited`.
* errors in words a user can act on: `AuthRequired` (401/403, gated repos: set `HF_TOKEN`),
  `NotFoundOnHub`, `HubUnreachable`, `OfflineUnavailable`.
* offline mode (`JETSHARD_OFFLINE=1` or `HF_HUB_OFFLINE=1`): no request is made at all.
* the manifest: after each file, its sha256 is computed (and compared with the Hub's LFS sha256 when the
  Hub gave one: huggingface_hub checks only sizes), the file is fsynced, and `.jetshard-manifest.json`
  is atomically rewritten to list every file now complete. The manifest never names a file that is not
  whole, so it can be written as files finish (a crash mid-model keeps the finished files' hashes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
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

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
_HASH_CHUNK = 8 * 1024 * 1024
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


def _offline_error(model_id: str) -> OfflineUnavailable:
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
            f"{model_id} was not found on the Hub; if it is private or gated, set HF_TOKEN to a token "
            "that can read it"
        )
    if isinstance(err, RevisionNotFoundError):
        return NotFoundOnHub(f"{model_id} has no revision {revision!r}")
    if isinstance(err, RemoteEntryNotFoundError):
        return NotFoundOnHub(f"{what} was not found on the Hub at revision {revision!r}")
    if isinstance(err, OfflineModeIsEnabled):
        return _offline_error(model_id)
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
    if isinstance(err, LocalEntryNotFoundError | ConnectionError | TimeoutError):
        return HubUnreachable(f"could not reach the Hub for {what}: {err}")
    return HubUnreachable(f"downloading {what} failed: {type(err).__name__}: {err}")


def _retry_after_s(err: HfHubHTTPError) -> float | None:
    if err.response is None:
        return None
    value = err.response.headers.get("Retry-After", "").strip()
    return float(value) if value.isdigit() else None


def _with_rate_limit_retries(
    call: Callable[[], Any], cancel: threading.Event, max_wait_s: float, what: str
) -> Any:
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
        raise _offline_error(model_id)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = _with_rate_limit_retries(
            lambda: api.model_info(model_id, revision=revision, files_metadata=True),
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
    """Byte counts of one fetch_files call, fed by the progress bars huggingface_hub creates."""

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
    """Never displays; forwards huggingface_hub's per-chunk updates to a _Tally (see module doc)."""

    tally: ClassVar[_Tally]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
        self.tally.bar_opened(kwargs.get("total"), int(kwargs.get("initial") or 0))

    def update(self, n: float | None = 1) -> bool | None:
        self.tally.advance(int(n or 0))
        return None

    def update_transfer(self, n: int) -> None:
        # Having this method makes huggingface_hub's Xet reporter use one bar, fed with bytes written to
        # disk; network transfer counts (which include retransfers) are not progress.
        pass


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


_manifest_locks: dict[Path, threading.Lock] = {}
_manifest_locks_guard = threading.Lock()


def _record_file(target: Path, base: Manifest, entry: ManifestFile) -> Manifest:
    """Add `entry` to the manifest on disk, keeping entries other fetches into `target` added meanwhile."""
    # Two shards of one model on one node download into the same directory at the same time; re-reading
    # under a lock keeps one's manifest rewrite from dropping the other's files. One downloader runs per
    # node, so a process-local lock is enough.
    with _manifest_locks_guard:
        lock = _manifest_locks.setdefault(target.resolve(), threading.Lock())
    with lock:
        current = read_manifest(target)
        if current is None or (current.model_id, current.revision) != (base.model_id, base.revision):
            current = base
        updated = current.merged(Manifest(model_id=base.model_id, revision=base.revision, files=(entry,)))
        write_manifest(target, updated)
        return updated


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
    already lists with the right size are skipped; the others go through huggingface_hub, which skips files
    it already finished for that commit. Returns the manifest as written: the files of this call plus those
    already listed.
    Raises FetchError subclasses (see module doc); ValueError for invalid ids or file names.
    """
    model_id = parse_model_id(model_id)
    names = [check_repo_filename(f.name) for f in files]
    if len(set(names)) != len(names):
        raise ValueError("fetch_files got the same file twice")
    if is_offline(environ):
        raise _offline_error(model_id)
    cancel = cancel or threading.Event()

    target.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(target)
    if existing is not None and (existing.model_id, existing.revision) != (model_id, revision):
        # The listed files may be replaced by another commit's version below; never let a manifest vouch
        # for a mix of commits.
        remove_manifest(target)
        existing = None
    manifest = existing or Manifest(model_id=model_id, revision=revision, files=())
    listed = manifest.sizes()

    tally = _Tally(sum(f.size or 0 for f in files), on_progress, cancel)
    bar_class = _progress_class(tally)
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

        def download(name: str = remote.name) -> str:
            return hf_hub_download(
                model_id,
                name,
                revision=revision,
                local_dir=target,
                token=token,
                endpoint=endpoint,
                tqdm_class=bar_class,
            )

        try:
            _with_rate_limit_retries(download, cancel, max_rate_limit_wait_s, f"{model_id}/{remote.name}")
            size = path.stat().st_size
            if remote.size is not None and size != remote.size:
                raise IntegrityError(
                    f"{model_id}/{remote.name} is {size} bytes on disk, the Hub says {remote.size}"
                )
            digest = sha256_file(path, cancel)
        except Exception as err:
            raise _translate(err, model_id, revision, remote.name) from err
        if remote.sha256 is not None and digest != remote.sha256.lower():
            path.unlink(missing_ok=True)
            raise IntegrityError(
                f"{model_id}/{remote.name} has sha256 {digest}, the Hub says {remote.sha256}; "
                "the file was deleted, retry the download"
            )
        manifest = _record_file(target, manifest, ManifestFile(remote.name, size, digest))
        tally.finish_file(size)

    return manifest
