"""The services' own commands (`jetshard sequencer|api|worker|downloader`), each one process of the cluster,
and `jetshard credentials`, the identities they connect to NATS as."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from jetshard_api.settings import ImageSettings, InferenceSettings
from jetshard_bus.options import DEFAULT_API_PORT, NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_downloader.config import DownloaderConfig
from jetshard_schema.types import ServingSettings
from jetshard_sequencer.config import SequencerConfig
from jetshard_worker.config import WorkerConfig

from jetshard.options import (
    Decorator,
    FieldFlags,
    checked_name,
    command_line,
    model_dir_options,
    nats_options,
    option,
    options_of,
    with_options,
)

_SEQUENCER_FLAGS = FieldFlags(SequencerConfig, ["snapshot_every", "failed_retention_s"])


@click.command()
@nats_options
@_SEQUENCER_FLAGS.add_to
@option(
    "--sequencer-id",
    default=None,
    callback=checked_name,
    help="what the leader lease (bucket jetshard-leader), this sequencer's command consumers and its log call it "
    "[default: seq-<random>]",
)
def sequencer(nats: NatsOptions, timings: BusTimings, sequencer_id: str | None, **flags: Any) -> None:
    """Turn commands into the ordered event stream (one leader; start more as standbys)."""
    from jetshard_bus.service import run_service
    from jetshard_sequencer.service import run_sequencer

    config = _SEQUENCER_FLAGS.value(flags, nats=nats, timings=timings)
    if sequencer_id is not None:
        config = dataclasses.replace(config, sequencer_id=sequencer_id)
    run_service("sequencer", lambda stop: run_sequencer(config, stop))


_INFERENCE_FLAGS = FieldFlags(
    InferenceSettings,
    [
        "command_timeout_s",
        "auto_place",
        "chunk_silence_s",
        "start_timeout_s",
        "first_chunk_timeout_s",
        "stream_ping_s",
        "model_keep_alive_s",
    ],
)
_IMAGE_FLAGS = FieldFlags(ImageSettings, ["fetch_urls", "fetch_timeout_s", "local_dirs"])
_SERVING_FLAGS = FieldFlags(
    ServingSettings, ["max_batch", "max_queued", "prefix_cache_bytes", "kv_cache_type", "draft"]
)
"""The serving settings of the instances an API places where a request does not set them."""

_API_SERVING_FLAGS: list[Decorator] = [
    *_INFERENCE_FLAGS.options(),
    *_IMAGE_FLAGS.options(),
    *_SERVING_FLAGS.options(),
    option(
        "--allowed-host",
        "allowed_hosts",
        multiple=True,
        help="also answer requests naming this Host (besides loopback names and --host's addresses); '*': any",
    ),
    option(
        "--cors-origin",
        "cors_origins",
        multiple=True,
        help="let web pages from this origin (scheme://host[:port]) call the API; none by default",
    ),
]
"""How `jetshard api` serves: its flags besides NATS, its address and its key. `jetshard up` takes the same and
passes them on to the API it starts (`api_serving_flags_passed_on`)."""


def _inference_settings(given: dict[str, Any]) -> InferenceSettings:
    """The `InferenceSettings` of `_API_SERVING_FLAGS`, popped from a command's parameters `given`."""
    serving, images = _SERVING_FLAGS.value(given), _IMAGE_FLAGS.value(given)
    return _INFERENCE_FLAGS.value(given, serving=serving, images=images)


def api_serving_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`_API_SERVING_FLAGS` for `jetshard api`: passed on as `inference` (`InferenceSettings`), `allowed_hosts`
    and `cors_origins`."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        return command(inference=_inference_settings(kwargs), **kwargs)

    return with_options(wrapper, _API_SERVING_FLAGS)


def api_serving_flags_passed_on(command: Callable[..., Any]) -> Callable[..., Any]:
    """`_API_SERVING_FLAGS` for `jetshard up`: passed on as `api_args`, the arguments that give the `jetshard api`
    it starts the same values. They are checked here: a bad one stops `up` before it starts."""
    options = options_of(_API_SERVING_FLAGS)

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {option_.name: kwargs.pop(option_.name) for option_ in options if option_.name is not None}
        _inference_settings(dict(given))
        return command(api_args=command_line(options, given), **kwargs)

    return with_options(wrapper, _API_SERVING_FLAGS)


@click.command()
@nats_options
@option("--host", default="127.0.0.1", show_default=True, help="address the HTTP API listens on")
@option("--port", type=int, default=DEFAULT_API_PORT, show_default=True, help="HTTP port (0: any free port)")
@option(
    "--port-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write the bound port here once listening",
)
@option(
    "--api-key", default=None, help="require this key ('Authorization: Bearer' or 'x-api-key'); /healthz stays open"
)
@api_serving_options
def api(
    nats: NatsOptions,
    timings: BusTimings,
    host: str,
    port: int,
    port_file: Path | None,
    api_key: str | None,
    inference: InferenceSettings,
    allowed_hosts: tuple[str, ...],
    cors_origins: tuple[str, ...],
) -> None:
    """Serve the OpenAI-compatible API and the cluster routes."""
    from jetshard_api.safety import HttpSafety, allowed_hosts_for
    from jetshard_api.service import ApiConfig, run_api
    from jetshard_bus.service import run_service

    config = ApiConfig(
        nats=nats,
        timings=timings,
        host=host,
        port=port,
        port_file=port_file,
        inference=inference,
        safety=HttpSafety(api_key or None, allowed_hosts_for(host, allowed_hosts), cors_origins),
    )
    run_service("api", lambda stop: run_api(config, stop))


_WORKER_FLAGS = FieldFlags(
    WorkerConfig,
    ["advertise_host", "runner_start_timeout_s", "build_llama_cpp", "llama_cpp_cpu_variants", "memory_limit_gib"],
)


@click.command()
@nats_options
@_WORKER_FLAGS.add_to
@option("--worker-session", default=None, hidden=True, help="this start's session id, chosen by `jetshard up`")
def worker(nats: NatsOptions, timings: BusTimings, worker_session: str | None, **flags: Any) -> None:
    """The node agent: node profile, custom model cards, shard runners."""
    from jetshard_bus.service import run_service
    from jetshard_worker.service import run_worker

    config = _WORKER_FLAGS.value(flags, nats=nats, timings=timings)
    if worker_session:
        config = dataclasses.replace(config, session_id=worker_session)
    run_service("worker", lambda stop: run_worker(config, stop))


_DOWNLOADER_FLAGS = FieldFlags(DownloaderConfig, ["offline", "advertise_host", "file_server_port", "peer_copies"])


@click.command()
@nats_options
@model_dir_options
@_DOWNLOADER_FLAGS.add_to
def downloader(
    nats: NatsOptions,
    timings: BusTimings,
    default_models_dir: str | None,
    models_dirs: str | None,
    models_read_only_dirs: str | None,
    **flags: Any,
) -> None:
    """Find models on this machine's disks and download what its shards need."""
    from jetshard_bus.service import run_service
    from jetshard_downloader.dirs import ModelDirs
    from jetshard_downloader.service import run_downloader

    def split(value: str | None) -> list[str]:
        return [part.strip() for part in (value or "").split(":") if part.strip()]

    dirs = ModelDirs.from_options(default_models_dir, split(models_dirs), split(models_read_only_dirs))
    config = _DOWNLOADER_FLAGS.value(flags, nats=nats, timings=timings, model_dirs=dirs)
    run_service("downloader", lambda stop: run_downloader(config, stop))


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@option(
    "--server-config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="a nats-server configuration to which DIRECTORY/nats.conf adds the authorization [default: none written]",
)
def credentials(directory: Path, server_config: Path | None) -> None:
    """Create the NATS identities of a cluster in DIRECTORY (once; later runs keep them): a 0600 nkey seed file
    per role (admin, sequencer, api, viewer, system; worker-<node>.nk and downloader-<node>.nk for this machine's node),
    and DIRECTORY/authorization.conf, the nats-server block that admits exactly them, each with its role's
    permissions. What `jetshard up` does for its embedded server; compose.yaml runs it for its NATS."""
    from jetshard_bus.node import config_dir, node_id_for

    from jetshard.up.auth import cluster_identities, server_authorization

    identities = cluster_identities(directory, node_id_for(config_dir()))
    authorization = server_authorization(list(identities.values()))
    (directory / "authorization.conf").write_text(authorization)
    if server_config is not None:
        (directory / "nats.conf").write_text(f"{server_config.read_text().rstrip()}\n\n{authorization}")
    for role, identity in sorted(identities.items()):
        click.echo(f"{role:<11} {identity.seed_file}")
