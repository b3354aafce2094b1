"""Partial files that survive the downloader being killed, resumed with an HTTP Range request through
huggingface_hub's own `http_get`.

`fetch.fetch_files` downloads each repo file through this module:

* bytes go to `<model dir>/.jetshard-partial/<name>.incomplete` (opened for appending), next to a small
  `<name>.incomplete.json` naming the revision, size and sha256 the bytes belong to; a partial file of
  another revision or size is discarded, never continued;
* `huggingface_hub.file_download.http_get(url, file, resume_size=<bytes already there>,
  expected_size=<size from the listing>)` sends `Range: bytes=<resume_size>-` and appends the rest (it also
  copes with a server that ignores the Range by rewinding and truncating), with huggingface_hub's retries,
  headers, redirects and error types; a connection dropped mid-file is resumed within the call the same way;
* once whole, `fetch_files` hashes the partial file and moves it into place, then drops its bookkeeping here.

`.jetshard-partial` is a name no repo file can take (`paths.check_repo_filename` reserves `.jetshard*`), and
its bytes count as "this model is partly here" for `choose_directory`, so a restarted download picks the
same directory again. huggingface_hub writes chunks of `DOWNLOAD_CHUNK_SIZE` (10 MiB by default, buffered in
memory until complete); `use_small_download_chunks` lowers it in this process so a kill loses at most
`RESUME_CHUNK_SIZE`.

Xet: files are fetched with plain HTTP from the `resolve` URL, which the Hub serves for Xet-backed files too
(with Range support). That gives up Xet's chunk deduplication in exchange for resuming across restarts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub.file_download import http_get

from jetshard_downloader.paths import check_repo_filename

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


def prepare_partial(partial: Path, revision: str, size: int | None, sha256: str | None) -> None:
    """Keep `partial` only if it belongs to this revision and size; record what it belongs to.

    `partial` exists (maybe empty) afterwards, so `drop_partial` and `sweep_partial_dir` for other files
    leave its folder alone.
    """
    meta = _meta_path(partial)
    wanted = {"revision": revision, "size": size, "sha256": sha256}
    try:
        known = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = None
    if known != wanted or size is None:
        partial.unlink(missing_ok=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if known != wanted:
        meta.write_text(json.dumps(wanted), encoding="utf-8")
    partial.touch()


def download_partial(
    url: str, headers: dict[str, str], partial: Path, name: str, size: int | None, bar_class: type
) -> None:
    """Append the bytes of `url` that `partial` still lacks, then fsync it."""
    with open(partial, "ab") as f:
        resume = f.tell()
        if size is not None and resume > size:
            f.truncate(0)
            resume = 0
        if resume:
            log.info("resuming %s at byte %d of %s", name, resume, size)
        http_get(
            url,
            f,
            resume_size=resume,
            headers=headers,
            expected_size=size,
            displayed_filename=name,
            tqdm_class=bar_class,
        )
        f.flush()
        os.fsync(f.fileno())


def drop_partial(partial: Path, target: Path) -> None:
    """Forget `partial` (moved into place, or found corrupt) and remove folders it leaves empty."""
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


def sweep_partial_dir(target: Path) -> None:
    """Remove `.jetshard-partial` from `target` when no partial file is left in it (only stale records)."""
    leftover = target / PARTIAL_DIR
    if leftover.is_dir() and not any(leftover.rglob("*.incomplete")):
        shutil.rmtree(leftover, ignore_errors=True)
