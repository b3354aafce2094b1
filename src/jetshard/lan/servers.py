"""The servers `jetshard up --lan` runs and tends: this machine's clustered nats-server, the founder's witness,
and the routes to the peers discovery finds (see `jetshard.lan` for why the topology is shaped so)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import click
import msgspec
from jetshard_bus.options import NatsOptions
from jetshard_bus.procs import describe_exit

from jetshard.lan.discovery import Discovery, Peer
from jetshard.lan.jetstream import (
    acquire_join_lock,
    ensure_replicas,
    meta_group,
    meta_leader,
    release_join_lock,
    retire_witness,
    wait_for_cluster_jetstream,
)
from jetshard.lan.membership import LanLayout, Membership, route_of, save_membership, signed, vouched
from jetshard.up.natsserver import NatsServer, ServerSettings, start_nats_server
from jetshard.up.supervisor import Supervisor

TEND_INTERVAL_S = 2.0
NAME_CHECK_S = 3.0
JOIN_TIMEOUT_S = 60.0
"""How long a new machine looks for the cluster's JetStream through its routes before it gives up."""


@dataclasses.dataclass
class LanServers:
    """This machine's servers of its LAN cluster, under `supervisor` at `stop_stage`, as `layout` says; routed
    to the peers `discovery` finds that prove they know the secret, and to `static_routes` (`--join`)."""

    layout: LanLayout
    discovery: Discovery
    static_routes: tuple[str, ...]
    supervisor: Supervisor
    logs: Path
    admin_nkey: Path
    system_nkey: Path
    report: Callable[[str], None]
    stop_stage: int
    store_lock_fd: int
    """The data directory's lock (`jetshard.up.lock`), which every server started on its stores inherits."""
    server: NatsServer | None = dataclasses.field(default=None, init=False)
    witness: NatsServer | None = dataclasses.field(default=None, init=False)
    next_tend: float = dataclasses.field(default=0.0, init=False)

    @property
    def membership(self) -> Membership:
        return self.layout.membership

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.layout.ports.client}"

    def routes(self) -> tuple[str, ...]:
        """Routes of this machine's server: every peer known, and the witness while it runs."""
        return tuple(sorted({*self.peer_routes(), *([self.layout.witness_route] if self._has_witness() else [])}))

    def peer_routes(self) -> tuple[str, ...]:
        found = (route_of(peer.host, peer.route_port) for peer in self.members())
        return tuple(sorted({*found, *self.static_routes, *self.membership.routes}))

    def members(self) -> list[Peer]:
        """The peers that proved they know the cluster's secret: only those are routed to."""
        return [p for p in self.discovery.cluster_peers() if vouched(p, self.membership.secret)]

    def _has_witness(self) -> bool:
        return self.membership.founder and not self.membership.witness_retired

    def start(self) -> None:
        if self.membership.founder and not (self.layout.root / "nats" / "jetstream").exists():
            self._check_name_is_free()
        save_membership(self.layout.root, self.membership)
        joining = not self.membership.joined
        if joining:
            self._join()
        self.supervisor.start("nats-server", self._start_server, self.stop_stage, self.logs / "nats-server.log")
        if self._has_witness():
            self.supervisor.start("nats-witness", self._start_witness, self.stop_stage, self.logs / "nats-witness.log")
        self._wait_for_meta_leader()
        if joining:
            admin, system = self._options(self.admin_nkey), self._options(self.system_nkey)
            asyncio.run(release_join_lock(admin, system, self.membership.server_name, JOIN_TIMEOUT_S))

    def _wait_for_meta_leader(self) -> None:
        """JetStream answers once its meta group has elected a leader: a second or two after the servers meet."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if (exited := self.supervisor.exited()) is not None:
                raise click.ClickException(
                    f"{exited.name} {describe_exit(exited.process.returncode)}; see {exited.log_file}"
                )
            try:
                if meta_leader(self.layout.ports.monitor) is not None:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise click.ClickException(
            f"JetStream elected no leader within {JOIN_TIMEOUT_S:.0f} s; see {self.logs / 'nats-server.log'}"
        )

    def _start_server(self) -> subprocess.Popen[bytes]:
        self.server = self._start(self.layout.server(self.routes(), jetstream=True), "nats-server")
        return self.server.process

    def _start_witness(self) -> subprocess.Popen[bytes]:
        self.witness = self._start(self.layout.witness(self.peer_routes()), "nats-witness")
        return self.witness.process

    def _start(self, settings: ServerSettings, name: str) -> NatsServer:
        assert settings.cluster is not None
        return start_nats_server(
            settings.store_dir,
            port=settings.port,
            log_file=self.logs / f"{name}.log",
            authorization=settings.authorization,
            cluster=settings.cluster,
            monitor_port=settings.monitor_port,
            fsync=settings.fsync,
            store_lock_fd=self.store_lock_fd,
        )

    def _check_name_is_free(self) -> None:
        """A new cluster must not take the name of one on the network: its machines would try routes to each other
        and be refused. Announcements arrive within a second or two of browsing."""
        deadline = time.monotonic() + NAME_CHECK_S
        while time.monotonic() < deadline:
            if peers := self.discovery.cluster_peers():
                cluster, names = self.membership.cluster, ", ".join(p.server_name for p in peers)
                raise click.ClickException(
                    f"a cluster named {cluster!r} already runs on this network ({names}): "
                    "to join it, run the `jetshard up --lan --join-token …` command one of its machines printed; to "
                    "start another, add --cluster NAME"
                )
            time.sleep(0.25)

    def _join(self) -> None:
        """Reach the cluster's JetStream with this server's own off, then keep JetStream on from now on."""
        cluster = self.membership.cluster
        self.report(f"looking for cluster {cluster!r} on the network…")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        strangers: list[Peer] = []
        while not self.peer_routes() and time.monotonic() < deadline:
            if strangers := self.discovery.cluster_peers():
                # Machines of that name that cannot prove the secret: once they have had a moment, the token is wrong.
                deadline = min(deadline, time.monotonic() + NAME_CHECK_S)
            time.sleep(0.25)
        if not self.peer_routes() and strangers:
            raise click.ClickException(
                f"the machines of cluster {cluster!r} on this network ({', '.join(p.server_name for p in strangers)}) "
                "do not know this machine's join token: use the token `jetshard up --lan` printed on one of them"
            )
        if not self.peer_routes():
            raise click.ClickException(
                f"found no machine of cluster {cluster!r} on this network within {JOIN_TIMEOUT_S:.0f} s; if "
                "multicast is blocked here, name one with --join HOST:PORT (its route port, 6222 by default)"
            )
        log_file = self.logs / "nats-server.log"
        log_start = log_file.stat().st_size if log_file.exists() else 0

        def refused() -> bool:
            """The peers' routes answer a wrong secret with an authorization violation, which our server logs."""
            with open(log_file, "rb") as log:
                log.seek(log_start)
                return b"authorization violation" in log.read().lower()

        server = self._start(self.layout.server(self.routes(), jetstream=False), "nats-server")
        try:
            peers = ", ".join(p.server_name for p in self.members()) or ", ".join(self.peer_routes())
            self.report(f"found {peers}; joining…")
            admin = self._options(self.admin_nkey)
            reached = asyncio.run(wait_for_cluster_jetstream(admin, JOIN_TIMEOUT_S, refused))
            if reached and not asyncio.run(acquire_join_lock(admin, self.membership.server_name, JOIN_TIMEOUT_S)):
                raise click.ClickException(
                    f"another machine has been joining cluster {cluster!r} for {JOIN_TIMEOUT_S:.0f} s; try again"
                )
        finally:
            server.stop()
        if not reached:
            why = "they refused this machine's join token" if refused() else "no route to them was established"
            raise click.ClickException(
                f"could not join cluster {cluster!r} ({peers}): {why}. Use the token `jetshard up --lan` printed on a "
                f"machine of the cluster; see {log_file}"
            )
        self._save(joined=True)

    def tend(self) -> None:
        """Add routes to newly found peers, and retire the witness once three machines hold data."""
        now = time.monotonic()
        if now < self.next_tend:
            return
        self.next_tend = now + TEND_INTERVAL_S
        if (known := self.peer_routes()) != self.membership.routes:
            self._save(routes=known)
        own = route_of(self.layout.address, self.layout.ports.route)
        for server, wanted in ((self.server, self.routes()), (self.witness, (own, *known))):
            if server is None or server.settings is None or server.process.poll() is not None:
                continue
            cluster = server.settings.cluster
            if cluster is not None and cluster.routes != wanted:
                server.reload(dataclasses.replace(server.settings, cluster=dataclasses.replace(cluster, routes=wanted)))
        if self.witness is not None and not self.membership.witness_retired:
            self._maybe_retire_witness()

    def _maybe_retire_witness(self) -> None:
        try:
            meta = asyncio.run(meta_group(self._options(self.system_nkey)))
        except Exception:  # the server is restarting: the next tend asks again
            return
        if not meta.witness_may_retire(self.membership.witness_name):
            return
        self.report("three machines hold the cluster's data: retiring the witness, streams move to 3 replicas")
        try:
            asyncio.run(
                retire_witness(
                    self._options(self.system_nkey), self._options(self.admin_nkey), self.membership.witness_name
                )
            )
        except Exception as error:  # the next tend tries again
            self.report(f"retiring the witness failed ({error}); trying again")
            return
        self.supervisor.retire("nats-witness")
        self.witness = None
        self._save(witness_retired=True)
        shutil.rmtree(self.layout.root / "nats-witness", ignore_errors=True)
        self.report("the witness is retired: every stream has 3 replicas, and any one machine may go away")

    def ensure_replicas(self) -> None:
        """After a restart of a founder whose witness retired: make sure the streams have their three replicas."""
        if self.membership.witness_retired:
            asyncio.run(ensure_replicas(self._options(self.admin_nkey)))

    def _options(self, nkey: Path) -> NatsOptions:
        return NatsOptions(servers=(self.nats_url,), nkey_file=str(nkey))

    def _save(self, **changes: object) -> None:
        membership = msgspec.structs.replace(self.membership, **changes)
        self.layout = dataclasses.replace(self.layout, membership=membership)
        save_membership(self.layout.root, membership)


def this_machine(layout: LanLayout, node_id: str, api_port: int) -> Peer:
    """What this machine tells the network: its cluster, server, node, where its routes and API listen, and
    the proof that it knows the cluster's secret."""
    unsigned = Peer(
        cluster=layout.membership.cluster,
        server_name=layout.membership.server_name,
        node_id=node_id,
        host=layout.address,
        route_port=layout.ports.route,
        api_port=api_port,
    )
    return signed(unsigned, layout.membership.secret)
