"""Option helpers shared by the `jetshard` commands: every flag `--x-y` also reads `JETSHARD_X_Y`."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import click
import msgspec
from jetshard_bus.options import DEFAULT_API_PORT, DEFAULT_NATS_URL, NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.ids import NAME_MAX_LENGTH, NAME_PATTERN
from jetshard_schema.types import ServingSettings

from jetshard.client import ApiClient
from jetshard.clusterfile import recorded

DEFAULT_API_URL = f"http://127.0.0.1:{DEFAULT_API_PORT}"
COMMAND_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
"""The click context of every command group and of the commands outside `main`'s: `-h`, and help 110 wide."""

_TIMING_HELP = {
    "lease_ttl_s": "a sequencer lease not renewed for this long passes to a standby",
    "liveness_ttl_s": "a node not heard from for this long is lost",
    "task_retention_s": "how long a task's request (its prompt) is kept in JETSHARD_TASKS; nothing keeps it longer",
}
"""A flag per `BusTimings` field, named after it."""


def option(*names: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A click option whose environment variable is derived from its long name: --x-y → JETSHARD_X_Y."""
    long_name = next(n for n in names if n.startswith("--")).split("/")[0]
    kwargs.setdefault("envvar", "JETSHARD_" + long_name[2:].replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


def seconds_option(name: str, default: float, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An `option` for a duration in seconds that must be above zero, its default shown."""
    return option(name, type=click.FloatRange(min=0, min_open=True), default=default, show_default=True, help=help)


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
        *(
            option(
                "--" + name.replace("_", "-"),
                type=float,
                default=getattr(BusTimings(), name),
                show_default=True,
                help=help,
            )
            for name, help in _TIMING_HELP.items()
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
        timings = BusTimings(**{name: kwargs.pop(name) for name in _TIMING_HELP})
        return command(nats=nats, timings=timings, **kwargs)

    for decorate in reversed(decorators):
        wrapper = decorate(wrapper)
    return wrapper


def api_url_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--api`, passed on as `api_url`: without it, the API `jetshard up` runs, else the default port here."""
    return option(
        "--api",
        "api_url",
        default=None,
        callback=lambda _context, _parameter, value: value or recorded("api") or DEFAULT_API_URL,
        help=f"base URL of a jetshard API [default: the one `jetshard up` runs, else {DEFAULT_API_URL}]",
    )(command)


def api_group(name: str, help: str) -> click.Group:
    """A command group taking `--api`, whose subcommands are passed (`click.pass_obj`) an `ApiClient` of it."""

    @click.group(name, help=help, context_settings=COMMAND_CONTEXT)
    @api_url_option
    @click.pass_context
    def group(context: click.Context, api_url: str) -> None:
        context.obj = ApiClient(api_url)

    return group


json_option = click.option("--json", "as_json", is_flag=True, help="print the API's JSON instead of a table")


def model_dir_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The model directory flags of `jetshard downloader`, which `jetshard up` passes on to it."""
    decorators = [
        option(
            "--default-models-dir",
            default=None,
            help="the default (first) writable model directory [$XDG_DATA_HOME/jetshard/models]",
        ),
        option("--models-dirs", default=None, help="more writable model directories, colon-separated, in order"),
        option(
            "--models-read-only-dirs",
            default=None,
            help="colon-separated directories searched first and never written (e.g. ~/.cache/huggingface/hub)",
        ),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


_SERVING_HELP = {
    "max_batch": "tasks of one instance that decode together",
    "max_queued": "tasks of one instance that may wait beyond --max-batch; past that, requests get 429",
    "prefix_cache_bytes": "bytes of prompt KV caches an instance keeps for prompts that start alike (0: none)",
}
"""A flag per `ServingSettings` field the API sets for the instances it places, named after it."""


def serving_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The serving settings of the instances an API places (`jetshard api`, and `jetshard up` passing them on
    to it) where a request does not set them; passed on as `serving`, checked against `ServingSettings`."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in _SERVING_HELP}
        try:
            serving = msgspec.convert(given, ServingSettings)
        except msgspec.ValidationError as error:
            raise click.BadParameter(str(error).replace("$.", "--").replace("_", "-")) from None
        return command(serving=serving, **kwargs)

    decorated: Callable[..., Any] = wrapper
    for name, help in reversed(_SERVING_HELP.items()):
        flag = "--" + name.replace("_", "-")
        decorated = option(flag, type=int, default=getattr(ServingSettings(), name), show_default=True, help=help)(
            decorated
        )
    return decorated


def serving_args(serving: ServingSettings) -> list[str]:
    """`serving_options`' flags for `serving`, to pass it on to a `jetshard api` process."""
    return [f"--{name.replace('_', '-')}={getattr(serving, name)}" for name in _SERVING_HELP]


def checked_name(_context: click.Context, _parameter: click.Parameter, value: str | None) -> str | None:
    """A click callback for an id that becomes a NATS subject token, a consumer name or a KV key (a task,
    an instance, a sequencer): the rules of `jetshard_schema.ids`, refused here rather than by the API."""
    if value is not None and (len(value) > NAME_MAX_LENGTH or not re.fullmatch(NAME_PATTERN, value)):
        raise click.BadParameter(f"use letters, digits, '_' and '-' (at most {NAME_MAX_LENGTH}), not {value!r}")
    return value
