"""A local HTTP server answering the Hugging Face Hub endpoints that `huggingface_hub` calls.

Point the real client at it with `HF_ENDPOINT=<server.url>` (see `hub_fixtures.py` for why the
environment variable alone is not enough inside an already-running process).

Served (model repos only, ids of the form "org/name"):

* `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: model info; `?blobs=true` adds
  sizes, blob ids and LFS data to `siblings`.
* `GET /api/models/{repo}/tree/{rev}[/{path}]` (`?recursive=true`): `list_repo_tree`.
* `POST /api/models/{repo}/paths-info/{rev}`: `get_paths_info`.
* `HEAD|GET /{repo}/resolve/{rev}/{path}`: file metadata and download, with `Range` support. No
  `X-Xet-*` header is ever sent, so the client always takes its plain HTTP download path.
* `GET /api/agent-harnesses`: an empty registry (the client fetches it for its user agent).

Files whose name looks like weights (`*.safetensors`, `*.bin`, ...) are served as LFS files, as
on the Hub: their ETag is the sha256 of the content and the HEAD carries `X-Linked-Size` and
`X-Linked-Etag`. Other files get the git blob sha1 as ETag.
"""

from __future__ import annotations

import hashlib
import json
import select
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_TOKEN = "hf_jetshard_test_token"
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".npz", ".h5", ".onnx", ".msgpack")
_SEND_CHUNK = 64 * 1024
_LFS_POINTER_SIZE = 134  # size of a git-lfs pointer file, as the Hub reports it


@dataclass(frozen=True)
class HubFile:
    path: str  # relative path in the repo, "/"-separated
    local_path: Path
    size: int
    blob_id: str  # git blob sha1
    sha256: str | None  # set for LFS files

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    sha: str  # the commit sha of the only revision, also reachable as `main`
    gated: bool = False
    private: bool = False
    # Tokens that may read a private repo or download from a gated one.
    tokens: set[str] = field(default_factory=lambda: {DEFAULT_TOKEN})
    config: dict[str, Any] | None = None
    safetensors: dict[str, Any] | None = None


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    status: int


@dataclass
class _Hold:
    n_bytes: int
    held: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Drop:
    n_bytes: int
    times: int


class HubServer:
    """The fake Hub. Use as a context manager, or call `start()` / `stop()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._repos: dict[str, HubRepo] = {}
        self._holds: dict[tuple[str, str], _Hold] = {}
        self._drops: dict[tuple[str, str], _Drop] = {}
        self._release = threading.Event()
        self._rate_limit_left = 0
        self._rate_limit_retry_after = 1
        self._rate_limit_repo: str | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: Counter[str] = Counter()  # URL path -> number of requests
        self.bytes_served: Counter[tuple[str, str]] = Counter()  # (repo_id, filename) -> body bytes sent
        self.request_log: list[RequestRecord] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HubServer:
        server = self

        class Handler(_HubHandler):
            hub = server

        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()  # unblock held downloads so their threads can finish
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ repos

    def add_repo(
        self,
        repo_id: str,
        path: Path,
        *,
        gated: bool = False,
        private: bool = False,
        tokens: set[str] | None = None,
    ) -> HubRepo:
        """Serve the files under `path` as repo `repo_id` (replacing an earlier one of that id).

        Contents are hashed now: files changed later are served with stale hashes, so call
        `add_repo` again after changing them (the commit sha changes with the content).
        """
        if repo_id.count("/") != 1:
            raise ValueError(f"repo ids must look like 'org/name', got {repo_id!r}")
        root = Path(path)
        files: dict[str, HubFile] = {}
        for local in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = local.relative_to(root).as_posix()
            if any(part.startswith(".") for part in rel.split("/")):
                continue  # .git, .cache and the like are not repo content
            files[rel] = _hash_file(rel, local)
        commit = hashlib.sha1(repo_id.encode())
        for f in files.values():
            commit.update(f"{f.path}\0{f.blob_id}\0".encode())
        repo = HubRepo(
            repo_id=repo_id,
            files=files,
            sha=commit.hexdigest(),
            gated=gated,
            private=private,
            tokens=set(tokens) if tokens is not None else {DEFAULT_TOKEN},
            config=_read_json(root / "config.json"),
            safetensors=_safetensors_summary(files.values()),
        )
        with self._lock:
            self._repos[repo_id] = repo
        return repo

    def remove_repo(self, repo_id: str) -> None:
        with self._lock:
            self._repos.pop(repo_id, None)

    def repo(self, repo_id: str) -> HubRepo:
        with self._lock:
            return self._repos[repo_id]

    # ------------------------------------------------------------------ behaviours

    def rate_limit(self, first_k: int, retry_after: int = 1, repo_id: str | None = None) -> None:
        """Answer the next `first_k` requests (for `repo_id` only, if given) with 429 + Retry-After."""
        with self._lock:
            self._rate_limit_left = first_k
            self._rate_limit_retry_after = retry_after
            self._rate_limit_repo = repo_id

    def hold_after(self, repo_id: str, filename: str, n_bytes: int) -> None:
        """GETs of this file send the file up to offset `n_bytes`, then block until `release()`.

        A blocked response also ends when its client disconnects (e.g. the downloading process
        is killed). Use `wait_held()` to know when a download has reached the hold point.
        """
        with self._lock:
            self._release.clear()
            self._holds[(repo_id, filename)] = _Hold(n_bytes)

    def wait_held(self, repo_id: str, filename: str, timeout: float = 30.0) -> bool:
        """Wait until a download of the file is blocked at its hold point."""
        with self._lock:
            hold = self._holds[(repo_id, filename)]
        return hold.held.wait(timeout)

    def release(self) -> None:
        """Let held downloads continue; later downloads are not held."""
        with self._lock:
            self._holds.clear()
            self._release.set()

    def drop_after(self, repo_id: str, filename: str, n_bytes: int, times: int = 1) -> None:
        """The next `times` GETs of this file close the connection at file offset `n_bytes`."""
        with self._lock:
            self._drops[(repo_id, filename)] = _Drop(n_bytes, times)

    def reset_counters(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served.clear()
            self.request_log.clear()

    def reset(self) -> None:
        """Forget repos, behaviours and counters (for a server shared between tests)."""
        self.release()
        with self._lock:
            self._repos.clear()
            self._drops.clear()
            self._rate_limit_left = 0
        self.reset_counters()

    # ------------------------------------------------------------------ used by the handler

    def _lookup(self, repo_id: str) -> HubRepo | None:
        with self._lock:
            return self._repos.get(repo_id)

    def _take_rate_limit(self, repo_id: str | None) -> int | None:
        with self._lock:
            if self._rate_limit_left <= 0:
                return None
            if self._rate_limit_repo is not None and self._rate_limit_repo != repo_id:
                return None
            self._rate_limit_left -= 1
            return self._rate_limit_retry_after

    def _take_drop(self, key: tuple[str, str]) -> int | None:
        with self._lock:
            drop = self._drops.get(key)
            if drop is None:
                return None
            drop.times -= 1
            if drop.times <= 0:
                del self._drops[key]
            return drop.n_bytes

    def _hold_for(self, key: tuple[str, str]) -> _Hold | None:
        with self._lock:
            return self._holds.get(key)

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests[record.path] += 1
            self.request_log.append(record)

    def _count_bytes(self, key: tuple[str, str], n: int) -> None:
        with self._lock:
            self.bytes_served[key] += n


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


class _HubHandler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests read server.request_log instead of stderr noise

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # ------------------------------------------------------------------ routing

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self._status = 0
        self._query = parse_qs(split.query)
        segments = [unquote(s) for s in split.path.split("/") if s]
        body = b""
        if method == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            self._route(method, segments, body)
        except _HubError as error:
            self._send_error(error)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.hub._record(RequestRecord(method, split.path, split.query, dict(self.headers.items()), self._status))

    def _route(self, method: str, seg: list[str], body: bytes) -> None:
        if seg[:2] == ["api", "agent-harnesses"]:
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        if len(seg) >= 4 and seg[:2] == ["api", "models"]:
            repo_id = f"{seg[2]}/{seg[3]}"
            self._check_rate_limit(repo_id)
            rest = seg[4:]
            if method == "GET" and not rest:
                return self._model_info(repo_id, "main")
            if method == "GET" and len(rest) == 2 and rest[0] == "revision":
                return self._model_info(repo_id, rest[1])
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                return self._tree(repo_id, rest[1], "/".join(rest[2:]))
            if method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
                return self._paths_info(repo_id, rest[1], body)
        if len(seg) >= 5 and seg[2] == "resolve" and method in ("GET", "HEAD"):
            repo_id = f"{seg[0]}/{seg[1]}"
            self._check_rate_limit(repo_id)
            return self._resolve(method, repo_id, seg[3], "/".join(seg[4:]))
        raise _HubError(404, None, "Not Found")

    def _check_rate_limit(self, repo_id: str) -> None:
        retry_after = self.hub._take_rate_limit(repo_id)
        if retry_after is not None:
            raise _HubError(
                429,
                None,
                "Too Many Requests",
                {
                    "Retry-After": str(retry_after),
                    # The Hub's IETF-draft headers; the client prefers them to Retry-After.
                    "RateLimit": f'"api";r=0;t={retry_after}',
                    "RateLimit-Policy": '"fixed window";"api";q=1000;w=300',
                },
            )

    # ------------------------------------------------------------------ access control

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _repo_for(self, repo_id: str, revision: str, *, download: bool) -> HubRepo:
        repo = self.hub._lookup(repo_id)
        token = self._token()
        if repo is None or (repo.private and token not in repo.tokens):
            # Like the Hub: a private repo is indistinguishable from a missing one, 401 without a
            # token, 404 with a token that has no access.
            status = 401 if token is None else 404
            raise _HubError(status, "RepoNotFound", "Repository not found")
        if download and repo.gated and token not in repo.tokens:
            # Gated repos are listed to anyone, their files are only served to allowed tokens.
            status = 401 if token is None else 403
            raise _HubError(
                status,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
            )
        if revision not in ("main", repo.sha):
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo

    # ------------------------------------------------------------------ endpoints

    def _model_info(self, repo_id: str, revision: str) -> None:
        repo = self._repo_for(repo_id, revision, download=False)
        blobs = self._query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in repo.files.values():
            sibling: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sibling.update(size=f.size, blobId=f.blob_id)
                if f.sha256 is not None:
                    sibling["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": _LFS_POINTER_SIZE}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": repo.sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": repo.sha,
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "library_name": "mlx",
            "pipeline_tag": "text-generation",
            "tags": ["mlx", "safetensors", "text-generation"],
            "siblings": siblings,
            "usedStorage": sum(f.size for f in repo.files.values()),
        }
        if repo.config is not None:
            info["config"] = {key: repo.config[key] for key in ("architectures", "model_type") if key in repo.config}
        if repo.safetensors is not None:
            info["safetensors"] = repo.safetensors
        self._send_json(info)

    def _tree(self, repo_id: str, revision: str, prefix: str) -> None:
        repo = self._repo_for(repo_id, revision, download=False)
        recursive = self._query.get("recursive", ["false"])[0].lower() == "true"
        base = f"{prefix}/" if prefix else ""
        if prefix and not any(p.startswith(base) for p in repo.files):
            raise _HubError(404, "EntryNotFound", f"{prefix} does not exist on {revision}")
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for f in repo.files.values():
            if not f.path.startswith(base):
                continue
            rest = f.path[len(base) :]
            if recursive:
                # Recursive listings also name every intermediate folder, as the Hub does.
                parts = rest.split("/")
                folders.update(base + "/".join(parts[: i + 1]) for i in range(len(parts) - 1))
                entries.append(_file_entry(f))
            elif "/" in rest:
                folders.add(base + rest.split("/")[0])
            else:
                entries.append(_file_entry(f))
        entries += [_folder_entry(folder) for folder in sorted(folders)]
        entries.sort(key=lambda e: e["path"])
        self._send_json(entries)

    def _paths_info(self, repo_id: str, revision: str, body: bytes) -> None:
        repo = self._repo_for(repo_id, revision, download=False)
        content_type = self.headers.get("Content-Type") or ""
        if content_type.startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        result: list[dict[str, Any]] = []
        for path in paths:
            path = path.strip("/")
            if path in repo.files:
                result.append(_file_entry(repo.files[path]))
            elif any(p.startswith(path + "/") for p in repo.files):
                result.append(_folder_entry(path))
        self._send_json(result)

    def _resolve(self, method: str, repo_id: str, revision: str, filename: str) -> None:
        repo = self._repo_for(repo_id, revision, download=True)
        f = repo.files.get(filename)
        if f is None:
            # X-Repo-Commit lets the client cache the file's absence for this commit.
            raise _HubError(
                404, "EntryNotFound", f"{filename} does not exist on {revision}", {"X-Repo-Commit": repo.sha}
            )
        start, end = 0, f.size  # [start, end)
        status = 200
        range_header = self.headers.get("Range")
        if range_header and method == "GET":
            parsed = _parse_range(range_header, f.size)
            if parsed is None:
                raise _HubError(
                    416,
                    None,
                    "Range Not Satisfiable",
                    {"Content-Range": f"bytes */{f.size}", "X-Repo-Commit": repo.sha},
                )
            start, end = parsed
            status = 206
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(end - start),
            "Accept-Ranges": "bytes",
            "ETag": f'"{f.etag}"',
            "X-Repo-Commit": repo.sha,
            "Content-Disposition": f'inline; filename="{filename.rsplit("/", 1)[-1]}"',
            "Last-Modified": formatdate(0, usegmt=True),
        }
        if f.sha256 is not None:
            # The Hub answers HEAD for LFS files with the real file's size and sha256 here.
            headers["X-Linked-Size"] = str(f.size)
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        self._start(status, headers)
        if method == "HEAD":
            return
        self._send_file(repo_id, f, start, end)

    # ------------------------------------------------------------------ responses

    def _send_file(self, repo_id: str, f: HubFile, start: int, end: int) -> None:
        key = (repo_id, f.path)
        drop_at = self.hub._take_drop(key)
        offset = start
        with f.local_path.open("rb") as src:
            src.seek(start)
            while offset < end:
                if drop_at is not None and offset >= drop_at:
                    # Simulate a broken connection: close without sending the rest.
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                hold = self.hub._hold_for(key)
                if hold is not None and offset >= hold.n_bytes:
                    self.wfile.flush()
                    if not self._wait_release(hold):
                        self.close_connection = True
                        return
                    continue
                limit = end
                if hold is not None:
                    limit = min(limit, hold.n_bytes)
                if drop_at is not None:
                    limit = min(limit, drop_at)
                chunk = src.read(min(_SEND_CHUNK, limit - offset))
                if not chunk:
                    break
                self.wfile.write(chunk)
                offset += len(chunk)
                self.hub._count_bytes(key, len(chunk))
        self.wfile.flush()

    def _wait_release(self, hold: _Hold) -> bool:
        """Block until release(); False if the client went away meanwhile."""
        hold.held.set()
        while not self.hub._release.wait(0.05):
            if self._client_gone():
                return False
        # A client killed just before release() must not be counted as receiving more bytes.
        return not self._client_gone()

    def _client_gone(self) -> bool:
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _start(self, status: int, headers: dict[str, str]) -> None:
        self._status = status
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_json(self, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._start(status, {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})})
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, error: _HubError) -> None:
        headers = dict(error.headers)
        if error.code is not None:
            headers["X-Error-Code"] = error.code
        headers["X-Error-Message"] = error.message
        self._send_json({"error": error.message}, error.status, headers)


# ---------------------------------------------------------------------- helpers


def _hash_file(rel: str, local: Path) -> HubFile:
    size = local.stat().st_size
    blob = hashlib.sha1(f"blob {size}\0".encode())
    sha256 = hashlib.sha256()
    with local.open("rb") as src:
        while chunk := src.read(1 << 20):
            blob.update(chunk)
            sha256.update(chunk)
    is_lfs = rel.endswith(LFS_SUFFIXES)
    return HubFile(rel, local, size, blob.hexdigest(), sha256.hexdigest() if is_lfs else None)


def _file_entry(f: HubFile) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
    if f.sha256 is not None:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": _LFS_POINTER_SIZE}
    return entry


def _folder_entry(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """`bytes=a-b`, `bytes=a-` or `bytes=-n` to a half-open interval; None if unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            start, end = max(size - int(last), 0), size
        else:
            start = int(first)
            end = min(int(last) + 1, size) if last else size
    except ValueError:
        return None
    if start >= size or start >= end:
        return None
    return start, end


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _safetensors_summary(files: Any) -> dict[str, Any] | None:
    """Parameter counts per dtype from the safetensors headers, as the Hub's model info has them."""
    counts: Counter[str] = Counter()
    for f in files:
        if not f.path.endswith(".safetensors"):
            continue
        with f.local_path.open("rb") as src:
            header_len = int.from_bytes(src.read(8), "little")
            header = json.loads(src.read(header_len))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in tensor["shape"]:
                n *= dim
            counts[tensor["dtype"]] += n
    if not counts:
        return None
    return {"parameters": dict(counts), "total": sum(counts.values())}
