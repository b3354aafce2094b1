"""The `jetshard` command. Every flag `--x-y` also reads the environment variable `JETSHARD_X_Y`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from jetshard_bus.options import DEFAULT_NATS_URL, NatsOptions
from jetshard_bus.streams import BusTimings

from jetshard.clusterfile import recorded

DEFAULT_API_PORT = 52415


def option(*names: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A click option whose environment variable is derived from its long name: --x-y → JETSHARD_X_Y."""
    long_name = next(n for n in names if n.startswith("--")).split("/")[0]
    kwargs.setdefault("envvar", "JETSHARD_" + long_name[2:].replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


def nats_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Connection and cluster-timing flags every service takes; passed on as `nats` and `timings`."""
    return _with_nats_options(command, lambda: DEFAULT_NATS_URL, DEFAULT_NATS_URL, lambda: None)


def client_nats_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`nats_options` for the commands that inspect a cluster: without `--nats`, the server `up` runs, as the
    read-only identity `up` recorded for them."""
    default_help = f"the one `jetshard up` runs, else {DEFAULT_NATS_URL}"
    return _with_nats_options(
        command, lambda: recorded("nats") or DEFAULT_NATS_URL, default_help, lambda: recorded("nats_nkey")
    )


def _with_nats_options(
    command: Callable[..., Any],
    default_url: Callable[[], str],
    default_help: str,
    default_nkey: Callable[[], str | None],
) -> Callable[..., Any]:
    decorators = [
        option("--nats", "nats_urls", multiple=True, help=f"NATS server URL; repeat for a cluster [{default_help}]"),
        option("--nats-user", help="NATS user name"),
        option("--nats-password", help="NATS password"),
        option("--nats-token", help="NATS token"),
        option("--nats-creds", type=click.Path(exists=True, dir_okay=False), help="NATS credentials file"),
        option(
            "--nats-nkey",
            type=click.Path(exists=True, dir_okay=False),
            help="file holding the NATS nkey seed of this identity (`jetshard up` writes them to <data dir>/creds)",
        ),
        option("--nats-tls-ca", type=click.Path(exists=True, dir_okay=False), help="CA certificate for TLS"),
        option("--nats-tls-cert", type=click.Path(exists=True, dir_okay=False), help="client certificate for TLS"),
        option("--nats-tls-key", type=click.Path(exists=True, dir_okay=False), help="client key for TLS"),
        option(
            "--replicas",
            type=int,
            default=1,
            show_default=True,
            help="replicas of jetshard's streams and buckets (3 on a NATS cluster)",
        ),
        option(
            "--lease-ttl-s",
            type=float,
            default=BusTimings().lease_ttl_s,
            show_default=True,
            help="a sequencer lease not renewed for this long passes to a standby",
        ),
        option(
            "--liveness-ttl-s",
            type=float,
            default=BusTimings().liveness_ttl_s,
            show_default=True,
            help="a node not heard from for this long is lost",
        ),
        option(
            "--task-retention-s",
            type=float,
            default=BusTimings().task_retention_s,
            show_default=True,
            help="how long a task's request (its prompt) is kept in JETSHARD_TASKS; nothing keeps it longer",
        ),
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        explicit_urls = kwargs.pop("nats_urls")
        urls = tuple(explicit_urls or (default_url(),))
        nkey_file = kwargs.pop("nats_nkey") or (None if explicit_urls else default_nkey())
        nats = NatsOptions(
            servers=urls,
            user=kwargs.pop("nats_user"),
            password=kwargs.pop("nats_password"),
            token=kwargs.pop("nats_token"),
            creds_file=kwargs.pop("nats_creds"),
            nkey_file=nkey_file,
            tls_ca=kwargs.pop("nats_tls_ca"),
            tls_cert=kwargs.pop("nats_tls_cert"),
            tls_key=kwargs.pop("nats_tls_key"),
            replicas=kwargs.pop("replicas"),
        )
        timings = BusTimings(
            lease_ttl_s=kwargs.pop("lease_ttl_s"),
            liveness_ttl_s=kwargs.pop("liveness_ttl_s"),
            task_retention_s=kwargs.pop("task_retention_s"),
        )
        return command(nats=nats, timings=timings, **kwargs)

    for decorate in reversed(decorators):
        wrapper = decorate(wrapper)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="jetshard")
def main() -> None:
    """jetshard: run large language models across the machines you already own."""


@main.command()
@nats_options
@option("--snapshot-every", type=int, default=1000, show_default=True, help="events between State snapshots")
def sequencer(nats: NatsOptions, timings: BusTimings, snapshot_every: int) -> None:
    """Turn commands into the ordered event stream (one leader; start more as standbys)."""
    from jetshard_bus.service import run_service
    from jetshard_sequencer.service import SequencerConfig, run_sequencer

    config = SequencerConfig(nats=nats, timings=timings, snapshot_every=snapshot_every)
    run_service("sequencer", lambda stop: run_sequencer(config, stop))


@main.command()
@nats_options
@option("--host", default="127.0.0.1", show_default=True, help="address the HTTP API listens on")
@option("--port", type=int, default=DEFAULT_API_PORT, show_default=True, help="HTTP port (0: any free port)")
@option(
    "--command-timeout-s",
    type=float,
    default=30.0,
    show_default=True,
    help="how long a route waits for its command's outcome before answering 504",
)
@option(
    "--port-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write the bound port here once listening",
)
@option(
    "--auto-place/--no-auto-place",
    default=True,
    show_default=True,
    help="place a model that has no instance when a request asks for it",
)
@option(
    "--chunk-silence-s",
    type=float,
    default=60.0,
    show_default=True,
    help="a generation silent this long (after its first chunk) ends with an error",
)
@option(
    "--api-key", default=None, help="require this key ('Authorization: Bearer' or 'x-api-key'); /healthz stays open"
)
@option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="also answer requests naming this Host (besides loopback names and --host's addresses); '*': any",
)
@option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="let web pages from this origin (scheme://host[:port]) call the API; none by default",
)
def api(
    nats: NatsOptions,
    timings: BusTimings,
    host: str,
    port: int,
    command_timeout_s: float,
    port_file: Path | None,
    auto_place: bool,
    chunk_silence_s: float,
    api_key: str | None,
    allowed_hosts: tuple[str, ...],
    cors_origins: tuple[str, ...],
) -> None:
    """Serve the OpenAI-compatible API and the cluster routes."""
    from jetshard_api.route_steps import InferenceSettings
    from jetshard_api.safety import HttpSafety, allowed_hosts_for
    from jetshard_api.service import ApiConfig, run_api
    from jetshard_bus.service import run_service

    inference = InferenceSettings(auto_place=auto_place, chunk_silence_s=chunk_silence_s)
    config = ApiConfig(
        nats=nats,
        timings=timings,
        host=host,
        port=port,
        command_timeout_s=command_timeout_s,
        port_file=port_file,
        inference=inference,
        safety=HttpSafety(api_key or None, allowed_hosts_for(host, allowed_hosts), cors_origins),
    )
    run_service("api", lambda stop: run_api(config, stop))


@main.command()
@nats_options
@option(
    "--advertise-host",
    default=None,
    help="address other nodes reach this node's runners on [default: the address used to reach NATS]",
)
@option(
    "--runner-start-timeout-s",
    type=float,
    default=300.0,
    show_default=True,
    help="a runner that has not loaded and joined its peers within this time is killed and reported",
)
@option("--worker-session", default=None, hidden=True, help="this start's session id, chosen by `jetshard up`")
def worker(
    nats: NatsOptions,
    timings: BusTimings,
    advertise_host: str | None,
    runner_start_timeout_s: float,
    worker_session: str | None,
) -> None:
    """The node agent: node profile, custom model cards, shard runners."""
    from jetshard_bus.service import run_service
    from jetshard_worker.service import WorkerConfig, run_worker

    config = WorkerConfig(
        nats=nats, timings=timings, advertise_host=advertise_host, runner_start_timeout_s=runner_start_timeout_s
    )
    if worker_session:
        config = dataclasses.replace(config, session_id=worker_session)
    run_service("worker", lambda stop: run_worker(config, stop))


@main.command()
@nats_options
@option(
    "--default-models-dir",
    default=None,
    help="the default (first) writable model directory [$XDG_DATA_HOME/jetshard/models]",
)
@option("--models-dirs", default=None, help="more writable model directories, colon-separated, in order")
@option(
    "--models-read-only-dirs",
    default=None,
    help="colon-separated directories searched first and never written (e.g. ~/.cache/huggingface/hub)",
)
@option("--offline", is_flag=True, help="make no network call (also HF_HUB_OFFLINE=1)")
def downloader(
    nats: NatsOptions,
    timings: BusTimings,
    default_models_dir: str | None,
    models_dirs: str | None,
    models_read_only_dirs: str | None,
    offline: bool,
) -> None:
    """Find models on this machine's disks and download what its shards need."""
    from jetshard_bus.service import run_service
    from jetshard_downloader.dirs import ModelDirs
    from jetshard_downloader.service import DownloaderConfig, run_downloader

    def split(value: str | None) -> list[str]:
        return [part.strip() for part in (value or "").split(":") if part.strip()]

    dirs = ModelDirs.from_options(default_models_dir, split(models_dirs), split(models_read_only_dirs))
    config = DownloaderConfig(nats=nats, timings=timings, model_dirs=dirs, offline=offline)
    run_service("downloader", lambda stop: run_downloader(config, stop))


@main.command()
@client_nats_options
@option("--since", type=int, default=None, help="first event sequence to show (default: only new events)")
def events(nats: NatsOptions, timings: BusTimings, since: int | None) -> None:
    """Print the event stream readably, live."""
    from jetshard.inspect import print_events

    _run(print_events(nats, since))


@main.command()
@client_nats_options
def state(nats: NatsOptions, timings: BusTimings) -> None:
    """Print the cluster State (rebuilt from the latest snapshot and the events after it)."""
    from jetshard.inspect import fetch_state

    json.dump(_run(fetch_state(nats)), sys.stdout, indent=2)
    sys.stdout.write("\n")


def _run(coroutine: Any) -> Any:
    """Run a one-shot tool's coroutine; Ctrl-C ends it quietly, an unreachable NATS with one clear line."""
    from jetshard_bus.connect import NatsUnreachableError
    from jetshard_bus.streams import StreamsMissingError

    try:
        return asyncio.run(coroutine)
    except KeyboardInterrupt:
        return None
    except (NatsUnreachableError, StreamsMissingError) as error:
        raise click.ClickException(str(error)) from None


from jetshard.up import up  # noqa: E402  (registered after the group exists)

main.add_command(up)
from jetshard.models_cli import models  # noqa: E402

main.add_command(models)
from jetshard.download_cli import download  # noqa: E402

main.add_command(download)

import jetshard.import_gguf  # noqa: E402, F401  (registers `models import-gguf`)
