"""The downloader shell: reports this node's model directories and fetches what its shards need.

A thin async shell around the pure storage core (dirs, locate, choose, fetch/resume, convert, delete); all
blocking work runs in threads. It acts on events for this node:

* `DownloadRequested`, `InstancePlaced` (a shard here: its layer range, with no further request), and at
  start-up every download State shows pending/ongoing here (resume after a restart): find the shard
  locally (read-only directories first; found: completed, no network call), else convert a packaged GGUF,
  else list the repo, choose a directory (counting what this process's running downloads still expect in
  each), and fetch the range's files, reporting progress at most once per second per model;
* `DownloadCancelled`: stop that download (finished files and the partial file in flight are kept), then
  report it stopped;
* `DownloadDeleteRequested`: delete the model from every writable directory, then `ReportDownloadDeleted`.

One job runs per model at a time (a second range of the same model waits, then finds the first's files).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from jetshard_bus.commands import publish_command
from jetshard_bus.connect import connect, disconnect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import local_address, node_id_for
from jetshard_bus.scratch import DOWNLOADER_PREFIX, make_scratch_dir
from jetshard_bus.stats import publish_stats
from jetshard_bus.tls_identity import PeerIdentity, client_context
from jetshard_schema.cards import ModelCard, ModelFormat, ModelSource
from jetshard_schema.commands import (
    Command,
    ReportDownloadDeleted,
    ReportDownloadProgress,
    ReportModelImport,
    ReportModelSize,
    ReportNodeStorage,
)
from jetshard_schema.events import (
    CustomModelCardDeleted,
    DownloadCancelled,
    DownloadDeleteRequested,
    DownloadRequested,
    EventEnvelope,
    InstancePlaced,
    InstanceRestarting,
    ModelImportRequested,
    NodeLost,
    NodeStorageUpdated,
)
from jetshard_schema.ids import ModelId, NodeId
from jetshard_schema.models import all_cards, find_card
from jetshard_schema.state import Download, Instance, State
from jetshard_schema.stats import DownloaderStats, DownloadFigures
from jetshard_schema.types import (
    DownloadProgress,
    DownloadStatus,
    FileServer,
    ImportProgress,
    ImportStatus,
    ModelDirInfo,
    NodeStorage,
    engine_format,
)

from jetshard_downloader.choose import Choice, NoSpace, choose_directory
from jetshard_downloader.config import DownloaderConfig
from jetshard_downloader.convert import (
    ProgressCallback,
    StoreHooks,
    TargetCallback,
    convert_packaged,
    install_gguf,
    place_packaged,
    sweep_staging,
)
from jetshard_downloader.delete import ReadOnlyModelError, delete_model, sweep_tombstones
from jetshard_downloader.dirs import ModelDirs, directory_report, minding_read_only_filesystems, room_bytes
from jetshard_downloader.fetch import (
    AuthRequired,
    Cancelled,
    FetchError,
    NotFoundOnHub,
    OfflineUnavailable,
    RateLimited,
    RepoListing,
    fetch_bytes,
    fetch_files,
    is_offline,
    list_remote_files,
    offline_error,
)
from jetshard_downloader.file_server import FileServer as PeerFileServer
from jetshard_downloader.hub_gguf import fetch_hub_gguf, hub_gguf_files, hub_gguf_ref
from jetshard_downloader.import_file import ImportRefused, read_import, store_import
from jetshard_downloader.local import complete_forms, default_form, find_shard, sized_form, weights_size
from jetshard_downloader.locate import Found, find_model, partial_bytes_for
from jetshard_downloader.paths import GGUF_NAME, GGUF_SUFFIX, INDEX_NAME, MMPROJ_NAME, SINGLE_WEIGHTS_NAME
from jetshard_downloader.peer_copy import PeerUnreachable, copy_files, fetch_manifest, fetch_small_json
from jetshard_downloader.peers import (
    PeerSource,
    admitted_certificates,
    awaited_sources,
    copy_sources,
    fetching_from_hub,
)
from jetshard_downloader.resume import use_small_download_chunks
from jetshard_downloader.shard_files import required_files

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 6.0
"""Longer than one progress report's publish (5 s timeout): a job waits this long at most for its last one."""
PEER_ADMISSION_WAITS_S = (0.25, 0.5, 1.0)
"""Waits before asking a source again that gave no answer (a moment after this session's storage report, its
server may not know this session's certificate yet); then the next source, or the Hub."""
HUB_FETCH_CHECK_S = 1.0
"""How often a node waiting for another to fetch a model from the Hub checks whether it was cancelled."""
STORAGE_REPORT_GRACE_S = 30.0
"""How long a node waits for an awaited source that is not fetching from the Hub (its fetch complete and not yet
reported as a source, or not begun) before it fetches the model itself."""
STOPPED = "stopped; the files fetched so far are kept for the next attempt"
"""The reason a cancelled download's record gives once its downloader has stopped it."""
T = TypeVar("T")


class _Progress:
    """The latest byte counts of one job, published as ReportDownloadProgress at most once per interval."""

    def __init__(
        self, publish: _Publisher, model_id: ModelId, start: int, end: int, interval_s: float, cancel: threading.Event
    ) -> None:
        self.publish = publish
        self.model_id = model_id
        self.start, self.end = start, end
        self.interval_s = interval_s
        self.cancel = cancel
        self.done = 0
        self.total = 0
        self.directory = ""
        self.form = ModelFormat.MLX
        self.source = ""
        self.samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self.dirty = False
        self.last_sent = 0.0
        self.wake = asyncio.Event()
        self.stopped = False

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        self.samples.append((time.monotonic(), done))
        self.dirty = True
        self.wake.set()

    def speed(self) -> float:
        now = time.monotonic()
        window = [(t, d) for t, d in self.samples if now - t <= 5.0]
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 0.0
        return max(0.0, (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]))

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    async def run(self) -> None:
        # Ends on `stop`, not only on cancellation: Python 3.11's wait_for (inside nats-py's publish) can
        # swallow a cancellation that lands as the publish completes, and the loop would wait for ever.
        while not self.stopped:
            await self.wake.wait()
            self.wake.clear()
            wait = self.interval_s - (time.monotonic() - self.last_sent)
            if wait > 0 and not self.stopped:
                await asyncio.sleep(wait)
            if self.stopped or not self.dirty or self.cancel.is_set():
                continue
            self.dirty = False
            self.last_sent = time.monotonic()
            speed = self.speed()
            eta = (self.total - self.done) / speed if speed > 0 and self.total >= self.done else None
            await self.publish(
                ReportDownloadProgress(
                    model_id=self.model_id,
                    node_id=self.publish.node_id,
                    progress=DownloadProgress(
                        status=DownloadStatus.ONGOING,
                        start_layer=self.start,
                        end_layer=self.end,
                        bytes_done=self.done,
                        bytes_total=self.total,
                        speed_bytes_per_s=round(speed, 1),
                        eta_s=None if eta is None else round(eta, 1),
                        directory=self.directory,
                        formats=(self.form,),
                        source=self.source,
                    ),
                )
            )


class _Publisher:
    def __init__(self, js: object, node_id: NodeId) -> None:
        self.js = js
        self.node_id = node_id

    async def __call__(self, command: Command) -> None:
        for attempt in range(5):
            try:
                await publish_command(self.js, command)  # type: ignore[arg-type]
                return
            except Exception as error:  # NATS briefly away: retry, then give up on this report
                log.warning("publishing %s failed (attempt %d): %s", type(command).__name__, attempt + 1, error)
                await asyncio.sleep(0.5 * (attempt + 1))


@dataclass
class _Job:
    model_id: ModelId
    start: int
    end: int
    cancel: threading.Event = field(default_factory=threading.Event)
    models_dir: Path | None = None
    remaining: int = 0
    """Bytes this job still expects to write into `models_dir` (its reservation)."""
    done: int = 0
    total: int = 0
    """The latest progress: bytes of the job's files on disk, of all it fetches."""
    transferring: bool = False
    """The Hub answered the listing: an error from now on happened mid-transfer and is worth a retry."""
    directory: str = ""
    """Where its files go, once chosen: every report of the job says so (a stopped one too)."""
    form: ModelFormat = ModelFormat.MLX
    """The form of the weights it makes available: the one the engine of the instance it serves loads."""
    source: str = ""
    """Where its bytes come from: "hub", or the node they are copied from ("" while nothing is fetched)."""


_NOT_RETRIED = (AuthRequired, NotFoundOnHub, OfflineUnavailable, RateLimited, Cancelled)
"""Errors another attempt would only repeat (rate limits were already waited out as the Hub asked)."""


class Downloader:
    def __init__(self, config: DownloaderConfig, publish: _Publisher, follower: StateFollower) -> None:
        self.config = config
        self.dirs = config.model_dirs
        self.publish = publish
        self.node_id = publish.node_id
        self.follower = follower
        self.environ = dict(os.environ)
        if config.offline:
            self.environ["JETSHARD_OFFLINE"] = "1"
        self.offline = is_offline(self.environ)
        self.hub_access: dict[str, Any] = {"token": config.token, "endpoint": config.endpoint, "environ": self.environ}
        """What each call into `fetch` needs to reach the Hub."""
        self.running: dict[ModelId, _Job] = {}
        self.locks: dict[ModelId, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.generation: dict[ModelId, int] = collections.defaultdict(int)
        """Bumped by a cancel or delete: requests queued before it for that model are dropped."""
        self.choose_lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.storage_changed = asyncio.Event()
        """Set when a model became complete here or was deleted: the storage report goes out now, not at its next
        interval, so other nodes may copy the model at once."""
        self.identity: PeerIdentity | None = None
        """This session's TLS identity, as a client of other nodes' file servers (None: no copies from peers)."""

    # --- events ------------------------------------------------------------------------------------------

    def on_event(self, envelope: EventEnvelope, state: State, live: bool) -> None:
        if not live:
            return
        match envelope.event:
            case DownloadRequested(node_id=node_id, model_id=model_id, start_layer=start, end_layer=end) if (
                node_id == self.node_id
            ):
                card = find_card(state, model_id)
                self.request(model_id, start, end, default_form(card) if card else ModelFormat.MLX)
            case InstancePlaced(instance_id=instance_id) | InstanceRestarting(instance_id=instance_id) if (
                instance_id in state.instances
            ):
                # A restart's runners need the files again, and they may be gone since (or the MLX form of them).
                self._request_for(state, state.instances[instance_id])
            case DownloadCancelled(node_id=node_id, model_id=model_id) if node_id == self.node_id:
                self.cancel(model_id)
            case CustomModelCardDeleted(model_id=model_id):
                self.cancel(model_id)  # State forgot its download with the card; what was fetched stays on disk
            case DownloadDeleteRequested(node_id=node_id, model_id=model_id) if node_id == self.node_id:
                self._spawn(self._delete(model_id))
            case ModelImportRequested(node_id=node_id) if node_id == self.node_id:
                self._spawn(self._import(envelope.event))

    def resume(self, state: State) -> None:
        """Pick up what State says this node was doing when the downloader stopped."""
        for download in state.downloads.get(self.node_id, {}).values():
            if download.deleting:
                self._spawn(self._delete(download.model_id))
            elif download.progress.status in (DownloadStatus.PENDING, DownloadStatus.ONGOING):
                card = find_card(state, download.model_id)
                start, end = download.progress.start_layer, download.progress.end_layer
                if end <= start:  # reported by a shard job before any DownloadRequested: the whole model
                    start, end = 0, card.num_layers if card else 0
                form = download.progress.formats[0] if download.progress.formats else None
                if end > start:
                    self.request(download.model_id, start, end, form or (default_form(card) if card else None))
        for instance in state.instances.values():
            self._request_for(state, instance)

    def _request_for(self, state: State, instance: Instance) -> None:
        """The files of `instance`'s shard on this node, if it has one, and of the model that drafts for it."""
        shard = instance.shard_for(self.node_id)
        if shard is not None:
            self.request(instance.model_id, shard.start_layer, shard.end_layer, engine_format(instance.serving.engine))
            self._request_draft(state, instance)

    def _request_draft(self, state: State, instance: Instance) -> None:
        """The model that drafts for `instance` (`serving.draft`), whole and in the form the instance's engine loads,
        where this node leads it and does not hold it yet."""
        draft = instance.serving.draft_model
        if draft is None or instance.failed or instance.leader_node != self.node_id:
            return
        download = state.download(self.node_id, draft)
        card = find_card(state, draft)
        form = engine_format(instance.serving.engine)
        if card is not None and (download is None or not download.progress.holds(form)):
            self.request(draft, 0, card.num_layers, form)

    def request(self, model_id: ModelId, start: int, end: int, form: ModelFormat | None) -> None:
        """Make layers `[start, end)` of `model_id` available here in `form` (None: MLX)."""
        form = form or ModelFormat.MLX
        job = self.running.get(model_id)
        if job is not None and not job.cancel.is_set() and job.start <= start and end <= job.end and job.form is form:
            return  # already being fetched
        self._spawn(self._run(model_id, start, end, form, self.generation[model_id]))

    def cancel(self, model_id: ModelId) -> None:
        self.generation[model_id] += 1
        job = self.running.get(model_id)
        if job is not None:
            log.info("cancelling the download of %s", model_id)
            job.cancel.set()

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[call-overload]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def shutdown(self) -> None:
        for job in self.running.values():
            job.cancel.set()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=10)

    def stats(self, interval_s: float) -> DownloaderStats:
        """The downloads under way, for `jetshard.stats`, every few seconds."""
        return DownloaderStats(
            interval_s=interval_s,
            node_id=self.node_id,
            downloads=tuple(
                DownloadFigures(model_id=job.model_id, done_bytes=job.done, expected_bytes=job.total)
                for job in list(self.running.values())
            ),
        )

    # --- reports -----------------------------------------------------------------------------------------

    async def _report(self, job: _Job, status: DownloadStatus, **fields: object) -> None:
        """Report this node's download of the job's model as `status`, over the job's layers unless `fields`
        name others; `fields` set the rest of its `DownloadProgress`."""
        progress = DownloadProgress(
            status=status,
            start_layer=job.start,
            end_layer=job.end,
            directory=job.directory,
            formats=(job.form,),
            source=job.source,
        )
        await self.publish(
            ReportDownloadProgress(
                model_id=job.model_id, node_id=self.node_id, progress=msgspec.structs.replace(progress, **fields)
            )
        )

    async def _written_into(self, job: _Job, card: ModelCard, directory: Path) -> tuple[Found, int]:
        """The job's layers found complete in `directory`, which it just wrote, and their bytes on disk."""
        found = await asyncio.to_thread(find_shard, self.dirs, card, job.start, job.end, job.form)
        if found is None or found[0].path != directory:
            raise FetchError(
                f"{job.model_id}: the files were written into {directory} but it does "
                "not hold the layer range completely; retry the download"
            )
        return found

    async def _report_completed(self, job: _Job, card: ModelCard, found: tuple[Found, int]) -> None:
        """Report the job's layers complete in `found`, with the bytes its files have on disk (not what a
        listing or a conversion said), and the model's real size where the whole model is here."""
        directory, read_only, bytes_total = found[0].path, found[0].read_only, found[1]
        # A node keeps one download record per model: report the widest range that is complete here, so a
        # second shard of a model does not make State forget the first.
        start, end = job.start, job.end
        existing = self.follower.state.download(self.node_id, job.model_id)
        done = existing.progress if existing is not None else None
        if done is not None and done.status is DownloadStatus.COMPLETED and done.end_layer > 0:
            wide = (min(start, done.start_layer), max(end, done.end_layer))
            if wide != (start, end):
                wider = await asyncio.to_thread(find_shard, self.dirs, card, *wide, job.form)
                if wider is not None and wider[0].path == directory:
                    start, end = wide
                    bytes_total = wider[1]
        if (start, end) == (0, card.num_layers) and job.form is sized_form(card):
            # The card's size came from a listing, an index or whoever added the card (an imported GGUF's, a
            # file replaced since): the files here are the truth.
            measured = await asyncio.to_thread(weights_size, self.dirs, card, directory, job.form)
            if measured != card.storage_size_bytes or card.storage_size_estimated:
                await self.publish(
                    ReportModelSize(node_id=self.node_id, model_id=job.model_id, storage_size_bytes=measured)
                )
        log.info("%s layers [%d, %d) complete in %s", job.model_id, start, end, directory)
        self.storage_changed.set()
        await self._report(
            job,
            DownloadStatus.COMPLETED,
            directory=str(directory),
            read_only=read_only,
            start_layer=start,
            end_layer=end,
            bytes_done=bytes_total,
            bytes_total=bytes_total,
            formats=await asyncio.to_thread(complete_forms, self.dirs, card, found[0], start, end),
        )

    # --- one download ------------------------------------------------------------------------------------

    async def _run(self, model_id: ModelId, start: int, end: int, form: ModelFormat, generation: int) -> None:
        async with self.locks[model_id]:
            if self.generation[model_id] != generation:
                return  # cancelled or deleted while queued
            job = _Job(model_id, start, end, form=form)
            self.running[model_id] = job
            try:
                await self._run_with_retries(job)
            except Cancelled:
                log.info("download of %s stopped", model_id)
                # Stopped because State says cancelled (not by a shutdown): State also learns it has stopped.
                if _cancelled(self.follower.state.download(self.node_id, model_id)):
                    await self._report(
                        job, DownloadStatus.CANCELLED, bytes_done=job.done, bytes_total=job.total, reason=STOPPED
                    )
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except Exception as error:
                if not isinstance(error, FetchError | OSError | ValueError):
                    log.exception("download of %s failed", model_id)
                    error = FetchError(f"{type(error).__name__}: {error}")
                log.warning("download of %s failed: %s", model_id, error)
                if not job.cancel.is_set():
                    await self._report(job, DownloadStatus.FAILED, reason=str(error))
            finally:
                if self.running.get(model_id) is job:
                    del self.running[model_id]

    async def _run_with_retries(self, job: _Job) -> None:
        backoffs = self.config.retry_backoff_s
        for attempt in range(len(backoffs) + 1):
            try:
                await self._run_job(job, attempt)
                return
            except FetchError as error:
                if not job.transferring or isinstance(error, _NOT_RETRIED) or attempt == len(backoffs):
                    raise
                wait_s = backoffs[attempt]
                log.warning("download of %s failed mid-transfer (%s); retrying in %.0f s", job.model_id, error, wait_s)
                await self._report(
                    job,
                    DownloadStatus.PENDING,
                    reason=f"retrying in {wait_s:.0f} s: {error}",
                    attempt=attempt + 1,
                    max_attempts=len(backoffs),
                )
                if await asyncio.to_thread(job.cancel.wait, wait_s):
                    raise Cancelled(f"download of {job.model_id} cancelled") from error

    async def _run_job(self, job: _Job, attempt: int) -> None:
        card = find_card(self.follower.state, job.model_id)
        if card is None:
            raise ValueError(f"unknown model {job.model_id}: no card in the catalogue")
        if not 0 <= job.start < job.end <= card.num_layers:
            job.start, job.end = 0, card.num_layers
        if job.form not in card.formats:
            raise FetchError(
                f"{job.model_id} has no {job.form} form, which its engine loads (it has {', '.join(card.formats)})"
            )
        found = await asyncio.to_thread(find_shard, self.dirs, card, job.start, job.end, job.form)
        if found is not None:
            known = self.follower.state.download(self.node_id, job.model_id)
            if not (
                known is not None
                and known.progress.holds(job.form)
                and known.progress.directory == str(found[0].path)
                and known.progress.start_layer <= job.start
                and job.end <= known.progress.end_layer
            ):
                await self._report_completed(job, card, found)
            return
        if card.source is ModelSource.HUB:
            copied = await self._from_peers(job, card, job.form)
            if copied is not None:
                await self._report_completed(job, card, await self._written_into(job, card, copied))
            else:
                await self._fetch(job, card, attempt)
        elif card.source is ModelSource.GGUF_PACKAGE:
            place = convert_packaged if job.form is ModelFormat.MLX else place_packaged
            await self._make(job, card, lambda hooks: place(card, self.dirs, hooks))
        elif job.form is ModelFormat.GGUF:
            await self._stored_gguf(job, card, attempt)
        else:  # the MLX directory converted from the GGUF stored here, beside it
            stored = await self._stored_gguf(job, card, attempt)
            await self._make(
                job,
                card,
                lambda hooks: install_gguf(
                    (stored / GGUF_NAME).resolve(),
                    self.dirs,
                    card.model_id,
                    bytes_needed=card.storage_size_bytes,
                    hooks=hooks,
                ),
            )

    async def _stored_gguf(self, job: _Job, card: ModelCard, attempt: int) -> Path:
        """The directory holding the card's GGUF on this node: an imported one's, or one fetched now from the Hub
        (reported complete when the job makes the GGUF form)."""
        found = await asyncio.to_thread(find_shard, self.dirs, card, 0, card.num_layers, ModelFormat.GGUF)
        if found is not None:
            return found[0].path
        copied = await self._from_peers(job, card, ModelFormat.GGUF)
        if copied is not None:
            if job.form is ModelFormat.GGUF:
                await self._report_completed(job, card, await self._written_into(job, card, copied))
            return copied
        if card.source is ModelSource.HUB_GGUF:
            return await self._fetch_hub_gguf(job, card, attempt)
        raise FetchError(
            f"{job.model_id} was imported from a local GGUF file and no model directory of this node holds it whole "
            "any more (removed, or changed since: the import links the original file where it can, so rewriting "
            "that file rewrites the model); import it again"
        )

    async def _fetch_hub_gguf(self, job: _Job, card: ModelCard, attempt: int) -> Path:
        """Fetch the card's GGUF files from its Hub repo into its model directory (`hub_gguf`); the directory."""
        repo = hub_gguf_ref(card).repo
        listing = await self._list_hub_repo(job, repo, attempt, card.storage_size_bytes)
        files = hub_gguf_files(card, listing)
        job.transferring = True
        model_dir = await self._write_into_chosen(
            job,
            sum(remote.size or 0 for remote, _ in files),
            f"downloading {job.model_id} from {repo}: {', '.join(remote.name for remote, _ in files)}",
            lambda model_dir, on_progress: fetch_hub_gguf(
                card, listing, files, model_dir, on_progress=on_progress, cancel=job.cancel, **self.hub_access
            ),
        )
        if job.form is ModelFormat.GGUF:
            await self._report_completed(job, card, await self._written_into(job, card, model_dir))
        return model_dir

    async def _make(
        self,
        job: _Job,
        card: ModelCard,
        work: Callable[[StoreHooks], tuple[Path, int]],
    ) -> None:
        """Make the job's form of the whole model on this node with blocking `work(hooks)` (a conversion, a
        packaged GGUF placed), reporting its progress, then its completion."""
        job.start, job.end = 0, card.num_layers  # always the whole model
        await self._report(job, DownloadStatus.PENDING, bytes_total=card.storage_size_bytes)
        log.info("making the %s form of %s from its GGUF", job.form, job.model_id)
        reserved = self._reserved_by_others(job)
        target, _ = await self._with_progress(
            job, lambda on_progress, on_target: work(StoreHooks(reserved, on_target, on_progress, job.cancel)), None
        )
        await self._report_completed(job, card, await self._written_into(job, card, target))

    async def _with_progress(
        self, job: _Job, work: Callable[[ProgressCallback, TargetCallback], T], directory: Path | None
    ) -> T:
        """Run blocking `work(on_progress, on_target)` in a thread while publishing its progress.

        `directory` is where the work writes; `on_target(model_dir, bytes_expected)` tells a new one, and
        the job's reservation moves there.
        """
        progress = _Progress(
            self.publish, job.model_id, job.start, job.end, self.config.progress_interval_s, job.cancel
        )
        if directory is not None:
            job.directory = str(directory)
        progress.directory, progress.form, progress.source = job.directory, job.form, job.source
        progress.last_sent = time.monotonic()  # the pending report just went out
        loop = asyncio.get_running_loop()
        base_remaining = job.remaining

        def on_progress(done: int, total: int) -> None:
            job.remaining = max(0, base_remaining - done)
            job.done, job.total = done, total
            loop.call_soon_threadsafe(progress.update, done, total)

        def on_target(model_dir: Path, bytes_expected: int) -> None:
            nonlocal base_remaining
            job.models_dir, job.remaining = model_dir.parent, bytes_expected
            base_remaining = bytes_expected
            job.directory = progress.directory = str(model_dir)

        reporter = asyncio.create_task(progress.run())
        try:
            return await asyncio.to_thread(work, on_progress, on_target)
        finally:
            # Never `await reporter` under a suppress(CancelledError): that would also swallow our own
            # cancellation. A report in flight may finish; the loop ends on `stop`.
            progress.stop()
            await asyncio.wait({reporter}, timeout=REPORT_TIMEOUT_S)
            reporter.cancel()

    async def _write_into_chosen(
        self, job: _Job, needed: int, what: str, work: Callable[[Path, ProgressCallback], object]
    ) -> Path:
        """Run blocking `work(model_dir, on_progress)`, which writes `needed` bytes into the model directory chosen
        for them, while publishing its progress; that directory. `what` says in the log what is written."""
        choice = await self._choose_directory(job, needed)
        log.info("%s, %d bytes into %s%s", what, needed, choice.model_dir, " (resuming)" if choice.resumes else "")
        await self._with_progress(
            job, lambda on_progress, _on_target: work(choice.model_dir, on_progress), choice.model_dir
        )
        return choice.model_dir

    async def _choose_directory(self, job: _Job, needed: int) -> Choice:
        """The models directory `job` downloads `needed` bytes into (the job reserves them there), one choice at a
        time so that two jobs never count the same free space."""
        async with self.choose_lock:
            choice = await asyncio.to_thread(
                choose_directory,
                self.dirs,
                job.model_id,
                needed,
                room_bytes,
                self._reserved_by_others(job),
                partial_bytes_for(job.model_id),
            )
        if isinstance(choice, NoSpace):
            raise FetchError(choice.message)
        job.models_dir, job.remaining = choice.models_dir, choice.bytes_remaining
        return choice

    def _reserved_by_others(self, job: _Job) -> dict[Path, int]:
        """Bytes the other running jobs still expect to write, per models directory."""
        reserved: dict[Path, int] = collections.defaultdict(int)
        for other in self.running.values():
            if other is not job and other.models_dir is not None:
                reserved[other.models_dir] += other.remaining
        return reserved

    async def _list_hub_repo(self, job: _Job, repo: str, attempt: int, bytes_total: int = 0) -> RepoListing:
        """The Hub's listing of the repo the job fetches from: refused offline, and PENDING first on a first attempt."""
        if self.offline:
            raise offline_error(job.model_id)
        job.source = "hub"
        if attempt == 0:
            await self._report(job, DownloadStatus.PENDING, bytes_total=bytes_total)
        return await asyncio.to_thread(list_remote_files, repo, cancel=job.cancel, **self.hub_access)

    async def _fetch(self, job: _Job, card: ModelCard, attempt: int) -> None:
        listing = await self._list_hub_repo(job, job.model_id, attempt)
        job.transferring = True
        names = [f.name for f in listing.files]
        sizes = {f.name: f.size or 0 for f in listing.files}
        index = None
        if INDEX_NAME in sizes:
            raw = await asyncio.to_thread(
                fetch_bytes,
                job.model_id,
                listing.revision,
                INDEX_NAME,
                size=sizes[INDEX_NAME] or None,
                **self.hub_access,
            )
            index = json.loads(raw)
            weights = set(index.get("weight_map", {}).values())
        else:
            weights = {SINGLE_WEIGHTS_NAME}
        measured = sum(sizes.get(name, 0) for name in weights)
        if measured and (card.storage_size_estimated or measured != card.storage_size_bytes):
            report = ReportModelSize(node_id=self.node_id, model_id=job.model_id, storage_size_bytes=measured)
            await self.publish(report)
        files = listing.select(required_files(names, index, card.num_layers, job.start, job.end))
        model_dir = await self._write_into_chosen(
            job,
            sum(f.size or 0 for f in files),
            f"downloading {job.model_id} layers [{job.start}, {job.end}): {len(files)} files",
            lambda model_dir, on_progress: fetch_files(
                job.model_id,
                listing.revision,
                model_dir,
                files,
                on_progress=on_progress,
                cancel=job.cancel,
                **self.hub_access,
            ),
        )
        await self._report_completed(job, card, await self._written_into(job, card, model_dir))

    # --- copies from other nodes ---------------------------------------------------------------------------

    async def _from_peers(self, job: _Job, card: ModelCard, form: ModelFormat) -> Path | None:
        """Copy what the job needs in `form` from the first node that has it (`peers.copy_sources`); the model
        directory written, or None when no node could give it (the caller asks the Hub then)."""
        if self.identity is None:
            return None  # --no-peer-copies
        sources = await self._sources_once_fetched(job, card, form)
        if sources:
            # The sources admit this session once State names its certificate: wait for this node's report.
            pem = self.identity.certificate_pem
            with contextlib.suppress(TimeoutError):
                await self.follower.wait_until(lambda state: _reported_certificate(state, self.node_id) == pem, 10)
        for source in sources:
            try:
                return await self._copy_from(job, card, form, source)
            except Cancelled:
                raise
            except (FetchError, OSError, ValueError, ssl.SSLError) as error:
                log.warning("copying %s from node %s failed: %s", job.model_id, source.node_id, error)
        job.source = ""
        return None

    async def _sources_once_fetched(self, job: _Job, card: ModelCard, form: ModelFormat) -> list[PeerSource]:
        """The nodes to copy from (`peers.copy_sources`); where none has the model yet but one is about to
        (`peers.awaited_sources`: fetching all of it from the Hub, or holding it unreported yet), once it has it and
        says so, or has given up."""
        state = self.follower.state
        sources = copy_sources(state, self.node_id, job.model_id, form)
        fetching = awaited_sources(state, self.node_id, card, form)
        if sources or not fetching:
            return sources
        log.info("copying %s from node %s once it has it all (and says so)", job.model_id, fetching[0])
        job.source = fetching[0]
        await self._report(job, DownloadStatus.PENDING)

        def settled(state: State) -> bool:
            return bool(copy_sources(state, self.node_id, job.model_id, form)) or not awaited_sources(
                state, self.node_id, card, form
            )

        quiet_s = 0.0
        while not job.cancel.is_set():
            with contextlib.suppress(TimeoutError):
                state = await self.follower.wait_until(settled, HUB_FETCH_CHECK_S)
                return copy_sources(state, self.node_id, job.model_id, form)
            still = [self.follower.state.download(n, job.model_id) for n in fetching]
            if not any(d is not None and fetching_from_hub(d.progress) for d in still):
                # Fetched and not reported as a source yet, or not begun (a downloader that is gone never will):
                # worth a wait, not for ever.
                quiet_s += HUB_FETCH_CHECK_S
                if quiet_s >= STORAGE_REPORT_GRACE_S:
                    return []
        raise Cancelled(f"the download of {job.model_id} was cancelled")

    async def _copy_from(self, job: _Job, card: ModelCard, form: ModelFormat, source: PeerSource) -> Path:
        assert self.identity is not None
        context = client_context(self.identity, source.certificate_pem)
        for wait_s in (*PEER_ADMISSION_WAITS_S, None):
            try:
                manifest = await asyncio.to_thread(fetch_manifest, source, context, job.model_id)
                break
            except PeerUnreachable:
                if wait_s is None:
                    raise
                await asyncio.sleep(wait_s)  # its server may not have applied our storage report yet
        listed = {entry.name: entry for entry in manifest.files}
        expected: dict[str, str] = {}
        if form is ModelFormat.GGUF:
            names = sorted(name for name in listed if name.endswith(GGUF_SUFFIX))
            if card.source is ModelSource.HUB_GGUF and card.source_sha256 and GGUF_NAME in listed:
                expected[GGUF_NAME] = card.source_sha256
            if not any(name != MMPROJ_NAME for name in names):
                raise FetchError(f"node {source.node_id} has no GGUF of {job.model_id}")
        else:
            index: dict[str, Any] | None = None
            if INDEX_NAME in listed:
                read = await asyncio.to_thread(fetch_small_json, source, context, job.model_id, listed[INDEX_NAME])
                if not isinstance(read, dict):
                    raise FetchError(f"the {INDEX_NAME} of {job.model_id} on node {source.node_id} is not an index")
                index = read
            start, end = (job.start, job.end) if form is job.form else (0, card.num_layers)
            names = sorted(required_files(listed, index, card.num_layers, start, end))
        needed = sum(listed[name].size for name in names)
        job.source = source.node_id
        await self._report(job, DownloadStatus.PENDING, bytes_total=needed)
        model_dir = await self._write_into_chosen(
            job,
            needed,
            f"copying {job.model_id} ({form}) from node {source.node_id}: {len(names)} files",
            lambda model_dir, on_progress: copy_files(
                source,
                context,
                manifest,
                model_dir,
                names,
                expected_sha256=expected,
                on_progress=on_progress,
                cancel=job.cancel,
            ),
        )
        if form is ModelFormat.GGUF and GGUF_NAME not in listed:  # a split model: model.gguf names its first part
            first = next(name for name in names if name != MMPROJ_NAME)
            await asyncio.to_thread(_link_first_part, model_dir, first)
        return model_dir

    # --- imports -----------------------------------------------------------------------------------------

    async def _import(self, request: ModelImportRequested) -> None:
        """Import a GGUF file on this node (`import_file`), reporting its progress, then the card or the problem."""
        model_id = request.model_id

        async def report(progress: ImportProgress, card: ModelCard | None = None) -> None:
            await self.publish(
                ReportModelImport(
                    node_id=self.node_id, import_id=request.import_id, model_id=model_id, progress=progress, card=card
                )
            )

        async with self.locks[model_id]:
            job = _Job(model_id, 0, 0)
            self.running[model_id] = job
            try:
                mmproj = Path(request.mmproj_path) if request.mmproj_path else None
                card, files = await asyncio.to_thread(read_import, model_id, Path(request.path), mmproj)
                log.info("importing %s from %s", model_id, request.path)
                loop = asyncio.get_running_loop()
                last_sent = [0.0]

                def on_progress(done: int, total: int) -> None:
                    job.done, job.total = done, total
                    now = time.monotonic()
                    if now - last_sent[0] >= self.config.progress_interval_s:
                        last_sent[0] = now
                        progress = ImportProgress(status=ImportStatus.ONGOING, bytes_done=done, bytes_total=total)
                        asyncio.run_coroutine_threadsafe(report(progress), loop)

                stored = await asyncio.to_thread(
                    store_import,
                    self.dirs,
                    model_id,
                    files,
                    replace=request.replace,
                    on_progress=on_progress,
                    cancel=job.cancel,
                )
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except (ImportRefused, OSError, Cancelled) as error:
                reason = str(error) if isinstance(error, ImportRefused | Cancelled) else f"the import failed: {error}"
                log.warning("import of %s failed: %s", model_id, reason)
                await report(ImportProgress(status=ImportStatus.FAILED, reason=reason))
                return
            except Exception as error:  # a bug: the import fails with it, the downloader goes on
                log.exception("import of %s failed", model_id)
                await report(ImportProgress(status=ImportStatus.FAILED, reason=f"{type(error).__name__}: {error}"))
                return
            finally:
                if self.running.get(model_id) is job:
                    del self.running[model_id]
            log.info("imported %s into %s", model_id, stored.directory)
            done = ImportProgress(
                status=ImportStatus.COMPLETED,
                bytes_done=stored.size_bytes,
                bytes_total=stored.size_bytes,
                directory=str(stored.directory),
            )
            await report(done, msgspec.structs.replace(card, source_sha256=stored.sha256))

    # --- deletes -----------------------------------------------------------------------------------------

    async def _delete(self, model_id: ModelId) -> None:
        self.cancel(model_id)
        async with self.locks[model_id]:  # wait for a running job to stop
            try:
                deleted = await asyncio.to_thread(delete_model, self.dirs, model_id)
                removed = tuple(str(p) for p in deleted.removed)
            except ReadOnlyModelError as error:
                # State thought the copy was writable (the configuration changed since): nothing of ours
                # is left to delete; the node forgets the record, the files stay.
                log.warning("%s", error)
                removed = ()
            log.info("deleted %s from %s", model_id, ", ".join(removed) or "nowhere")
            self.storage_changed.set()
            await self.publish(ReportDownloadDeleted(model_id=model_id, node_id=self.node_id, directories=removed))


def _reported_certificate(state: State, node_id: NodeId) -> str | None:
    storage = state.node_storage.get(node_id)
    return storage.file_server.certificate_pem if storage is not None and storage.file_server is not None else None


def _link_first_part(model_dir: Path, first: str) -> None:
    link = model_dir / GGUF_NAME
    if not os.path.lexists(link):
        os.symlink(first, link)


def _cancelled(download: Download | None) -> bool:
    return download is not None and download.progress.status is DownloadStatus.CANCELLED


def _storage(
    dirs: ModelDirs, offline: bool, model_ids: Iterable[ModelId], file_server: FileServer | None = None
) -> NodeStorage:
    return NodeStorage(
        model_dirs=tuple(
            ModelDirInfo(path=str(d.path), read_only=d.read_only, free_bytes=d.free_bytes, total_bytes=d.total_bytes)
            for d in directory_report(dirs)
        ),
        offline=offline,
        available_models=tuple(m for m in model_ids if find_model(dirs, m) is not None),
        file_server=file_server,
    )


async def run_downloader(config: DownloaderConfig, stop: asyncio.Event) -> None:
    node_id = node_id_for(config.config_dir)
    dirs = minding_read_only_filesystems(config.model_dirs)
    for mounted in set(dirs.read_only) - set(config.model_dirs.read_only):
        log.warning("model dir %s is on a read-only filesystem: its models serve, nothing is stored there", mounted)
    config = dataclasses.replace(config, model_dirs=dirs)
    use_small_download_chunks()
    for models_dir in config.model_dirs.writable:
        with contextlib.suppress(OSError):
            sweep_tombstones(models_dir)
            sweep_staging(models_dir)
    client, js = await connect(config.nats, f"jetshard-downloader {node_id}", config.timings, declare_streams=False)
    follower = StateFollower(js)
    downloader = Downloader(config, _Publisher(js, node_id), follower)
    follower.add_listener(downloader.on_event)
    with contextlib.ExitStack() as scratch:
        server: PeerFileServer | None = None
        advertised: FileServer | None = None
        if config.peer_copies:
            # A fresh identity per session, its key in a private scratch directory removed at exit (or, where the
            # downloader was killed, at the next start).
            directory = make_scratch_dir(DOWNLOADER_PREFIX)
            scratch.callback(shutil.rmtree, directory, ignore_errors=True)
            downloader.identity = PeerIdentity.create(directory, f"downloader-{node_id}")
            server = PeerFileServer(config.model_dirs, downloader.identity)
            host = config.advertise_host or local_address(client)
            port = await server.start(host, config.file_server_port)
            advertised = FileServer(
                host=host,
                port=port,
                certificate_pem=downloader.identity.certificate_pem,
            )

            def admit(envelope: EventEnvelope, state: State, live: bool) -> None:
                if isinstance(envelope.event, NodeStorageUpdated | NodeLost):
                    server.admit(admitted_certificates(state, node_id))

            follower.add_listener(admit)
        await follower.start()
        if server is not None:
            server.admit(admitted_certificates(follower.state, node_id))
        log.info(
            "downloader for node %s started; model dirs %s%s%s",
            node_id,
            config.model_dirs,
            " (offline)" if downloader.offline else "",
            f"; serving files to peers on {advertised.host}:{advertised.port}" if advertised else "",
        )

        async def report_storage() -> None:
            storage = await asyncio.to_thread(
                _storage, config.model_dirs, downloader.offline, list(all_cards(follower.state)), advertised
            )
            try:
                await publish_command(js, ReportNodeStorage(node_id=node_id, storage=storage))
            except Exception as error:
                log.warning("storage report failed: %s", error)

        # Before any copy starts: the other nodes' file servers admit this session's certificate once State has it.
        await report_storage()
        downloader.resume(follower.state)
        stats = asyncio.create_task(publish_stats(client, downloader.stats))
        try:
            while not stop.is_set():
                waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(downloader.storage_changed.wait())]
                try:
                    await asyncio.wait(waits, timeout=config.storage_interval_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                downloader.storage_changed.clear()
                if not stop.is_set():
                    await report_storage()
        finally:
            stats.cancel()
            await downloader.shutdown()
            if server is not None:
                await server.close()
            await follower.stop()
            await disconnect(client)
