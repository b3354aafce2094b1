"""Option helpers shared by the `jetshard` commands: every flag `--x-y` also reads `JETSHARD_X_Y`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import click
import msgspec
import msgspec.inspect
from jetshard_bus.options import DEFAULT_API_PORT, DEFAULT_NATS_URL, NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.ids import parse_name

from jetshard.client import ApiClient
from jetshard.clusterfile import recorded

DEFAULT_API_URL = f"http://127.0.0.1:{DEFAULT_API_PORT}"
COMMAND_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
"""The click context of every command group and of the commands outside `main`'s: `-h`, and help 110 wide."""

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
T = TypeVar("T")


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


class FieldFlags(Generic[T]):
    """A flag per field of `struct` named in `names`, in that order, all of it read from the field: its name
    (x_y: `--x-y`; a bool's `--x-y/--no-x-y`), its environment variable, its default, its choices (an enum's
    values), and the help and bounds its `msgspec.Meta` gives (`description`; `ge`, `gt`, `le`, `lt`). The Meta's
    `extra` may name the flag otherwise (`{"flag": "--x"}`: the field is named within its struct, the flag within
    the command), make a bool a lone switch (`{"switch": True}`) and mark a `tuple[str, ...]` as directories
    (`{"directory": True}`); a tuple's flag is repeatable. Each flag's parameter is named after its field."""

    def __init__(self, struct: type[T], names: Sequence[str]) -> None:
        info = msgspec.inspect.type_info(struct)
        assert isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType)
        fields = {field.name: field for field in info.fields}
        self.struct = struct
        self.fields = [_FieldFlag.of(fields[name]) for name in names]

    def options(self) -> list[Decorator]:
        return [field.option() for field in self.fields]

    def add_to(self, command: Callable[..., Any]) -> Callable[..., Any]:
        """`command` with `options`, as a decorator."""
        return with_options(command, self.options())

    def value(self, given: dict[str, Any], **more: Any) -> T:
        """The `struct` of the values of `options`, popped from a command's parameters `given`, and of `more` of
        its fields; a value the field refuses is a `click.BadParameter` naming its flag."""
        values = {field.name: given.pop(field.name) for field in self.fields}
        try:
            return msgspec.convert({**values, **more}, self.struct)
        except msgspec.ValidationError as error:
            message = str(error)
            for field in self.fields:
                message = message.replace(f"$.{field.name}", field.flag)
            raise click.BadParameter(message) from None


@dataclass(frozen=True)
class _FieldFlag:
    name: str
    declaration: str
    kind: msgspec.inspect.Type
    default: Any
    help: str | None
    directory: bool

    @classmethod
    def of(cls, field: msgspec.inspect.Field) -> _FieldFlag:
        kind: msgspec.inspect.Type = field.type
        schema: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if isinstance(field.type, msgspec.inspect.Metadata):
            kind, schema, extra = field.type.type, field.type.extra_json_schema or {}, field.type.extra or {}
        if isinstance(kind, msgspec.inspect.UnionType):  # X | None: None is the default, given by no flag
            (kind,) = (member for member in kind.types if not isinstance(member, msgspec.inspect.NoneType))
        declaration = extra.get("flag", flag_of(field.name))
        if isinstance(kind, msgspec.inspect.BoolType) and not extra.get("switch"):
            declaration = f"{declaration}/--no-{declaration[2:]}"
        help = schema.get("description")
        return cls(field.name, declaration, kind, field.default, help, extra.get("directory", False))

    @property
    def flag(self) -> str:
        return self.declaration.split("/")[0]

    def option(self) -> Decorator:
        settings: dict[str, Any] = {"default": self.default, "show_default": self.default not in (None, ())}
        if isinstance(self.kind, msgspec.inspect.BoolType):
            settings["is_flag"] = True
        elif isinstance(self.kind, msgspec.inspect.IntType | msgspec.inspect.FloatType):
            settings["type"] = _range_of(self.kind)
        elif isinstance(self.kind, msgspec.inspect.EnumType):
            default = None if self.default is None else self.default.value
            settings.update(type=click.Choice([member.value for member in self.kind.cls]), default=default)
        elif isinstance(self.kind, msgspec.inspect.VarTupleType):
            settings.update(multiple=True, type=click.Path(file_okay=False) if self.directory else str)
        return option(self.declaration, self.name, help=self.help, **settings)


class FiniteFloat(click.FloatRange):
    """A float, in a range where one is given, never nan or infinite: click's FloatRange lets nan through (it
    compares false), and no JSON body or flag value holds one."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _range_of(number: msgspec.inspect.IntType | msgspec.inspect.FloatType) -> click.ParamType:
    """The click type of a number field: a range where the field has bounds."""
    low = number.ge if number.gt is None else number.gt
    high = number.le if number.lt is None else number.lt
    integer = isinstance(number, msgspec.inspect.IntType)
    if low is None and high is None:
        return click.INT if integer else FiniteFloat()
    open_ends = {"min_open": number.gt is not None, "max_open": number.lt is not None}
    if integer:
        return click.IntRange(low, high, **open_ends)  # type: ignore[arg-type]  # an IntType's bounds are ints
    return FiniteFloat(low, high, **open_ends)


TIMING_FLAGS = FieldFlags(BusTimings, ["lease_ttl_s", "liveness_ttl_s", "task_retention_s"])
"""The cluster's timings every service takes (`nats_options`)."""


def nats_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Connection and cluster-timing flags every service takes; passed on as `nats` and `timings`."""
    return _with_nats_options(command, lambda: DEFAULT_NATS_URL, DEFAULT_NATS_URL, lambda: None, service=True)


def client_nats_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The connection flags of `nats_options` for the commands that inspect a cluster, passed on as `nats`:
    without `--nats`, the server `up` runs, as the read-only identity `up` recorded for them. They declare no
    stream, so they take no replicas or timings."""
    default_help = f"the one `jetshard up` runs, else {DEFAULT_NATS_URL}"
    return _with_nats_options(
        command,
        lambda: recorded("nats") or DEFAULT_NATS_URL,
        default_help,
        lambda: recorded("nats_nkey"),
        service=False,
    )


def _with_nats_options(
    command: Callable[..., Any],
    default_url: Callable[[], str],
    default_help: str,
    default_nkey: Callable[[], str | None],
    service: bool,
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
    ]
    if service:
        decorators += [
            option(
                "--replicas",
                type=int,
                default=1,
                show_default=True,
                help="replicas of jetshard's streams and buckets (3 on a NATS cluster)",
            ),
            *TIMING_FLAGS.options(),
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
            **({"replicas": kwargs.pop("replicas")} if service else {}),
        )
        if not service:
            return command(nats=nats, **kwargs)
        return command(nats=nats, timings=TIMING_FLAGS.value(kwargs), **kwargs)

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


json_option = click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")


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
    if value is None:
        return None
    try:
        return parse_name(value, "id")
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
