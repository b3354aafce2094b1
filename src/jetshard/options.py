"""Option helpers shared by the `jetshard` commands: every flag `--x-y` also reads `JETSHARD_X_Y`."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
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


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def flag_of(name: str) -> str:
    """The flag of a parameter or field named `name`: x_y → --x-y."""
    return "--" + name.replace("_", "-")


def environment_variable(flag: str) -> str:
    """The environment variable a flag also reads: --x-y → JETSHARD_X_Y."""
    return "JETSHARD_" + flag[2:].replace("-", "_").upper()


def option(*names: str, **kwargs: Any) -> Decorator:
    """A click option that also reads the `environment_variable` of its long name."""
    long_name = next(n for n in names if n.startswith("--")).split("/")[0]
    kwargs.setdefault("envvar", environment_variable(long_name))
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


def with_options(command: Callable[..., Any], decorators: Sequence[Decorator]) -> Callable[..., Any]:
    """`command` with `decorators` applied as if written above it in this order (their flags in help so)."""
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


def seconds_option(name: str, default: float, help: str) -> Decorator:
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
                flag_of(name),
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

    return with_options(wrapper, decorators)


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


_MODEL_DIR_HELP = {
    "default_models_dir": "the default (first) writable model directory [$XDG_DATA_HOME/jetshard/models]",
    "models_dirs": "more writable model directories, colon-separated, in order",
    "models_read_only_dirs": "colon-separated directories searched first and never written "
    "(e.g. ~/.cache/huggingface/hub)",
}
"""A flag per model directory parameter of `jetshard downloader`, named after it."""


def model_dir_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The model directory flags of `jetshard downloader`, which `jetshard up` passes on to it
    (`model_dir_environment`)."""
    return with_options(
        command, [option(flag_of(name), default=None, help=help) for name, help in _MODEL_DIR_HELP.items()]
    )


def model_dir_environment(**given: str | None) -> dict[str, str]:
    """The `model_dir_options` given (by parameter name) as the environment variables their flags read, to pass
    them on to a `jetshard downloader` process."""
    return {environment_variable(flag_of(name)): value for name, value in given.items() if value is not None}


_SERVING_HELP = {
    "max_batch": "tasks of one instance that decode together",
    "max_queued": "tasks of one instance that may wait beyond --max-batch; past that, requests get 429",
    "prefix_cache_bytes": "bytes of prompt KV caches an instance keeps for prompts that start alike (0: none)",
}
"""A flag per `ServingSettings` field the API sets for the instances it places, named after it."""


SERVING_FLAGS: list[Decorator] = [
    option(flag_of(name), type=int, default=getattr(ServingSettings(), name), show_default=True, help=help)
    for name, help in _SERVING_HELP.items()
]
"""The serving settings of the instances an API places where a request does not set them; read with
`serving_settings`."""


def serving_settings(given: dict[str, Any]) -> ServingSettings:
    """The values of `SERVING_FLAGS`, popped from a command's parameters `given` and checked against
    `ServingSettings`."""
    values = {name: given.pop(name) for name in _SERVING_HELP}
    try:
        return msgspec.convert(values, ServingSettings)
    except msgspec.ValidationError as error:
        raise click.BadParameter(str(error).replace("$.", "--").replace("_", "-")) from None


def options_of(decorators: Sequence[Decorator]) -> list[click.Option]:
    """The options `decorators` declare, as the command they decorate has them."""
    params = click.command()(with_options(lambda **_: None, decorators)).params
    return [param for param in params if isinstance(param, click.Option)]


def command_line(options: Sequence[click.Option], values: Mapping[str, Any]) -> list[str]:
    """The arguments that give a command with `options` the `values` (by parameter name): how a command passes
    the flags it took on to a process of a command that takes the same."""
    args: list[str] = []
    for option_ in options:
        assert option_.name is not None  # every option has a parameter name
        value = values[option_.name]
        flag = next(name for name in option_.opts if name.startswith("--"))
        if option_.is_flag and option_.secondary_opts:
            args.append(flag if value else option_.secondary_opts[0])
        elif option_.is_flag:
            args.extend([flag] if value else [])
        elif option_.multiple:
            args.extend(f"{flag}={item}" for item in value)
        elif value is not None:
            args.append(f"{flag}={value}")
    return args


def checked_name(_context: click.Context, _parameter: click.Parameter, value: str | None) -> str | None:
    """A click callback for an id that becomes a NATS subject token, a consumer name or a KV key (a task,
    an instance, a sequencer): the rules of `jetshard_schema.ids`, refused here rather than by the API."""
    if value is not None and (len(value) > NAME_MAX_LENGTH or not re.fullmatch(NAME_PATTERN, value)):
        raise click.BadParameter(f"use letters, digits, '_' and '-' (at most {NAME_MAX_LENGTH}), not {value!r}")
    return value
