"""`jetshard up`: the whole cluster on this machine — embedded NATS plus the four services: its flags, and the
order of a start (NATS, the services, the model) and of a stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import click
import httpx
from jetshard_bus.node import node_profile, unused_gpu_hint
from jetshard_bus.options import DEFAULT_API_PORT
from jetshard_bus.procs import describe_exit
from jetshard_schema.catalogue import DEMO_MODEL_ID
from jetshard_worker.config import WorkerConfig
from rich.console import Console

from jetshard.clusterfile import data_dir, remove_cluster_file, write_cluster_file
from jetshard.commands.engines import llama_cpp_hint, llama_cpp_ready_line
from jetshard.commands.services import api_serving_flags_passed_on
from jetshard.lan.options import LanChoice, lan_options
from jetshard.lan.servers import LanServers
from jetshard.options import model_dir_environment, model_dir_options, option
from jetshard.up.auth import ADMIN, VIEWER
from jetshard.up.lock import Holder, lock_data_dir
from jetshard.up.nats import UpNats, start_nats
from jetshard.up.natsserver import Fsync, NatsServerError
from jetshard.up.placing import place_and_wait
from jetshard.up.services import Services, service_arguments, services_environment
from jetshard.up.supervisor import STOP_SIGNALS, Supervisor

STOP_GRACE_S = (1.2, 2.0, 1.0, 0.8)
"""Per stop stage, between SIGTERM and SIGKILL: a whole stop takes under 5 s even when a service hangs."""
LLAMA_CPP_LOOK_S = 5.0
"""How often `up` looks whether the background llama.cpp build is ready, to say so (a few small files read)."""


@click.command()
@option(
    "--nats",
    "nats_url",
    default=None,
    help="join this NATS server instead of starting the embedded one",
)
@option(
    "--nats-port",
    type=int,
    default=4222,
    show_default=True,
    help="port of the embedded NATS server (loopback only)",
)
@option(
    "--fsync",
    type=click.Choice(Fsync, case_sensitive=False),
    default=Fsync.ALWAYS.value,
    show_default=True,
    help="when the NATS servers `up` starts put JetStream's writes on disk: `always` before acknowledging them "
    "(an acknowledged write survives a power loss), `interval` every two minutes (faster; an OS crash or a power "
    "loss loses what was acknowledged since)",
)
@option("--host", default=None, help="API address [default: 127.0.0.1; with --lan every interface]")
@option("--port", type=int, default=DEFAULT_API_PORT, show_default=True, help="API port")
@option("--api-key", default=None, help="require this key of API clients")
@option(
    "--data-dir",
    "state_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="where NATS keeps the cluster's history and services their logs",
)
@option("--offline", is_flag=True, help="make no network call at all")
@option(
    "--model",
    default=DEMO_MODEL_ID,
    show_default=True,
    help="model to place once the cluster is up",
)
@option("--no-model", is_flag=True, help="place no model")
@lan_options
@api_serving_flags_passed_on
@model_dir_options
def up(
    nats_url: str | None,
    nats_port: int,
    fsync: Fsync,
    host: str | None,
    port: int,
    api_key: str | None,
    state_dir: Path | None,
    offline: bool,
    model: str,
    no_model: bool,
    lan: LanChoice | None,
    api_args: list[str],
    default_models_dir: str | None,
    models_dirs: str | None,
    models_read_only_dirs: str | None,
) -> None:
    """Start everything on this machine; Ctrl-C stops it all. Running it again keeps the history."""
    console = Console(highlight=False)
    root = state_dir or data_dir()
    host = host or ("0.0.0.0" if lan else "127.0.0.1")
    api_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    # Before anything reads or writes the data directory (a second start must not even rebuild the store, or
    # remove the first one's cluster file when it stops).
    nats_shown = _without_userinfo(nats_url or f"nats://127.0.0.1:{nats_port}")
    store_lock_fd = lock_data_dir(root, Holder(os.getpid(), api_url, nats_shown))
    _refuse_a_taken_port(host, port)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_on_signal)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(STOP_GRACE_S, report=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
    stops_before_servers = contextlib.ExitStack()
    try:
        nats = start_nats(
            nats_url, nats_port, fsync, lan, port, root, store_lock_fd, supervisor, console, stops_before_servers
        )
        lan_servers = nats.lan_servers
        # Runners of one model on several machines reach each other on the address the LAN sees.
        advertise_host = lan_servers.layout.address if lan_servers else None
        services = Services(
            nats,
            services_environment(
                nats.url,
                offline,
                model_dir_environment(
                    default_models_dir=default_models_dir,
                    models_dirs=models_dirs,
                    models_read_only_dirs=models_read_only_dirs,
                ),
            ),
            service_arguments(host, port, api_args, advertise_host),
            api_key,
            logs,
        )
        services.start(supervisor)
        _wait_healthy(api_url, supervisor, logs)
        viewer = nats.identities[VIEWER].seed_file if nats.identities else None
        write_cluster_file(root, api_url, nats.url, viewer, api_key)
        _print_up(console, api_url, nats, logs)
        if (hint := unused_gpu_hint(node_profile())) is not None:
            console.print(f"[yellow]{hint}[/]", soft_wrap=True)
        if lan_servers is not None:
            _print_lan(console, lan_servers, host, port, api_key)

        def tend() -> bool:
            supervisor.tend()
            if lan_servers is not None:
                lan_servers.tend()
            return True

        if not no_model:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            place_and_wait(console, api_url, model, services.worker_session, tend, headers)
        # The worker's own flag, read as click reads it there.
        given = os.environ.get("JETSHARD_BUILD_LLAMA_CPP", str(WorkerConfig.build_llama_cpp))
        build_allowed = click.BOOL.convert(given, None, None)
        if (llama_cpp := llama_cpp_hint(build_allowed)) is not None:
            console.print(f"[yellow]{llama_cpp.text}[/]", soft_wrap=True)
        console.print("Press Ctrl-C to stop.")
        awaiting_llama_cpp = llama_cpp is not None and llama_cpp.building
        next_look = time.monotonic()
        while tend():
            if awaiting_llama_cpp and time.monotonic() >= next_look:
                next_look += LLAMA_CPP_LOOK_S
                if (ready := llama_cpp_ready_line()) is not None:
                    console.print(f"[green]{ready}[/]", soft_wrap=True)
                    awaiting_llama_cpp = False
            time.sleep(0.2)
    except NatsServerError as error:
        raise click.ClickException(f"{error} (see {logs / 'nats-server.log'})") from None
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stops_before_servers.close()
        supervisor.stop()
        remove_cluster_file(root)
        console.print("stopped")


def _print_up(console: Console, api_url: str, nats: UpNats, logs: Path) -> None:
    shown_url = _without_userinfo(nats.url)
    nats_cli = f"nats --server {shown_url}"
    if nats.identities:
        nats_cli += f" --nkey {nats.identities[ADMIN].seed_file}"
    console.print(
        f"[bold green]jetshard is up[/]\n  API   {api_url}  (OpenAI base URL: {api_url}/v1)\n"
        f"  NATS  {shown_url}  (as admin: {nats_cli} stream view JETSHARD_EVENTS)\n"
        f"  logs  {logs}",
        soft_wrap=True,
    )


def _print_lan(console: Console, lan_servers: LanServers, host: str, port: int, api_key: str | None) -> None:
    membership = lan_servers.membership
    layout = lan_servers.layout
    console.print(
        f"  LAN   cluster {membership.cluster!r}, this machine {membership.server_name} at {layout.address} "
        f"(routes on port {layout.ports.route})\n"
        f"  Add a machine: [bold]jetshard up --lan --join-token {membership.token}[/]",
        soft_wrap=True,
    )
    if host in ("0.0.0.0", "::") and not api_key:
        console.print(
            f"[yellow]The API on http://{layout.address}:{port} answers anyone on this network: set --api-key "
            "(or JETSHARD_API_KEY) to require a key.[/]",
            soft_wrap=True,
        )


def _without_userinfo(url: str) -> str:
    """The URL to show: a user name or password in it stays off the screen."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _stop_on_signal(signum: int, frame: object) -> None:
    # The first signal starts the ordered stop; more (a terminal sends one to the whole foreground group,
    # `uv run` may forward another) must not interrupt it half-way.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _refuse_a_taken_port(host: str, port: int) -> None:
    """Said before anything starts: the API would only exit, its reason in its log."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API binds: a closing socket is no user
        try:
            probe.bind((host, port))
        except OSError as error:
            raise click.ClickException(
                f"the API cannot listen on {host}:{port}: {error.strerror}; stop what holds the port, or pass --port"
            ) from None


def _wait_healthy(api_url: str, supervisor: Supervisor, logs: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (exited := supervisor.exited()) is not None:
            raise click.ClickException(
                f"{exited.name} {describe_exit(exited.process.returncode)}; see {exited.log_file}"
            )
        try:
            if httpx.get(f"{api_url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise click.ClickException(f"the API did not become healthy within {timeout_s:.0f} s; see {logs}")
