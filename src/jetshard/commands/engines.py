"""`jetshard engines …`: which engines this machine can run, and building llama.cpp for it."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any, NamedTuple

import click
import msgspec
from rich.table import Table

from jetshard.options import COMMAND_CONTEXT, json_option, option
from jetshard.output import print_answer

if TYPE_CHECKING:
    from jetshard_worker.engines.llamacpp.build import Progress

LLAMA_CPP = "llama.cpp"


def engines_status() -> list[dict[str, Any]]:
    """Each engine with whether it is ready here, and for llama.cpp each cached build and its probe on this CPU."""
    from jetshard_worker.engines.llamacpp.build import builds_under_way, cache_root, cached_builds
    from jetshard_worker.engines.llamacpp.probe import passed_here, ready_build

    mlx = {"engine": "mlx", "ready": True, "detail": f"mlx {importlib.metadata.version('mlx')} (Python package)"}
    ready = ready_build()
    llama_cpp: dict[str, Any] = {"engine": LLAMA_CPP, "ready": ready is not None, "cache": str(cache_root())}
    llama_cpp["builds"] = [
        {
            "path": str(build.root),
            "cpu_variants": build.record.cpu_variants.value,
            "compiler": build.record.compiler,
            "build_duration_s": build.record.duration_s,
            "probe": None if (passed := passed_here(build)) is None else msgspec.to_builtins(passed),
        }
        for build in cached_builds()
    ]
    llama_cpp["compiling"] = [msgspec.to_builtins(build) for build in builds_under_way()]
    if ready is not None:
        llama_cpp["llama_server"] = str(ready.llama_server)
        llama_cpp["variant"] = ready.probe.variant
        llama_cpp["dropped"] = [f"{d.variant} ({d.reason})" for d in ready.probe.dropped]
    return [mlx, llama_cpp]


def engines_table(status: list[dict[str, Any]]) -> Table:
    table = Table(title="engines", title_justify="left")
    table.add_column("engine", no_wrap=True)
    table.add_column("ready")
    table.add_column("detail", overflow="fold")
    for engine in status:
        if engine["engine"] != LLAMA_CPP:
            table.add_row(engine["engine"], "yes", engine["detail"])
            continue
        if engine["ready"]:
            lines = [engine["llama_server"], f"CPU variant: {engine['variant']}"]
            lines.append("dropped: " + (", ".join(engine["dropped"]) or "none"))
        elif engine["compiling"]:
            lines = [f"compiling {build['key']}: {progress_text(build['progress'])}" for build in engine["compiling"]]
        elif engine["builds"]:
            lines = [
                f"{b['path']}: not yet probed on this CPU; "
                f"`jetshard engines build llama.cpp --cpu-variants {b['cpu_variants']}` probes it"
                for b in engine["builds"]
            ]
        else:
            lines = [f"not built (cache: {engine['cache']}): `jetshard engines build llama.cpp` compiles it"]
        table.add_row(LLAMA_CPP, "yes" if engine["ready"] else "no", "\n".join(lines))
    return table


def progress_text(progress: dict[str, Any] | None) -> str:
    """A build's last step as a person reads it: `compile 43%`."""
    if progress is None:
        return "starting"
    percent = progress.get("percent")
    return f"{progress['phase']} {percent:.0f}%" if percent is not None else str(progress["phase"])


class LlamaCppHint(NamedTuple):
    text: str
    building: bool
    """A build is under way here: `jetshard up` says so again once it is ready (`llama_cpp_ready_line`)."""


def llama_cpp_hint(build_allowed: bool) -> LlamaCppHint | None:
    """What `jetshard up` says of llama.cpp on a machine that cannot run it yet (`build_allowed`: its worker compiles
    one in the background); None where it can."""
    from jetshard_worker.engines.llamacpp.build import BuildError, find_toolchain

    status = engines_status()[1]
    if status["ready"]:
        return None
    if not build_allowed:
        text = "llama.cpp is not built on this machine, so MLX serves: `jetshard engines build llama.cpp` compiles it"
        return LlamaCppHint(text, building=False)
    try:
        find_toolchain()
    except BuildError as error:
        return LlamaCppHint(f"llama.cpp cannot be built here, so MLX serves: {error}", building=False)
    how_far = progress_text(status["compiling"][0]["progress"]) if status["compiling"] else "starting"
    text = (
        f"llama.cpp is compiling in the background ({how_far}; about 12 minutes on a 2-core machine, once; "
        "`jetshard engines` shows how far): MLX serves meanwhile, and the model moves to llama.cpp once it is built "
        "and idle"
    )
    return LlamaCppHint(text, building=True)


def llama_cpp_ready_line() -> str | None:
    """What `jetshard up` says when the background build has passed its probe; None until then."""
    from jetshard_worker.engines.llamacpp.probe import ready_build

    ready = ready_build()
    if ready is None:
        return None
    return f"llama.cpp is built (CPU variant {ready.probe.variant}): models move to it as soon as they are idle"


@click.group(context_settings=COMMAND_CONTEXT, invoke_without_command=True)
@click.pass_context
def engines(context: click.Context) -> None:
    """The engines this machine can run (mlx, llama.cpp); `build llama.cpp` compiles llama.cpp for it."""
    if context.invoked_subcommand is None:
        context.invoke(status)


@engines.command()
@json_option
def status(as_json: bool = False) -> None:
    """Each engine and whether it is ready here (llama.cpp: its path, CPU variant and the variants dropped)."""
    print_answer(engines_status(), as_json, engines_table)


@engines.command()
@click.argument("engine", type=click.Choice([LLAMA_CPP]))
@option(
    "--cpu-variants",
    type=click.Choice(["all", "avx2"]),
    default="all",
    show_default=True,
    help="all: every CPU variant ggml has for this architecture (fastest everywhere; ~20-40 min on 2 cores); "
    "avx2: one AVX2 library for any x86 machine of the last decade (a few times quicker to build)",
)
def build(engine: str, cpu_variants: str) -> None:
    """Compile ENGINE (llama.cpp: from the pinned llama-cpp-python sdist) once for this machine, or find it cached,
    and check it on this CPU."""
    from jetshard_worker.engines.llamacpp.build import BuildError, CpuVariants
    from jetshard_worker.engines.llamacpp.probe import ProbeError, build_and_probe

    shown: list[tuple[str, int | None]] = []

    def on_progress(progress: Progress) -> None:
        # A line per phase and per whole percent: cmake prints a line per file, hundreds of them.
        step = (progress.phase.value, None if progress.percent is None else int(progress.percent))
        if shown and shown[-1] == step and progress.phase.value not in ("probe", "configure"):
            return
        shown.append(step)
        percent = "" if progress.percent is None else f"{progress.percent:3.0f}% "
        click.echo(f"{engine}: {progress.phase.value:<9} {percent}{progress.detail}"[:200])

    try:
        ready = build_and_probe(CpuVariants(cpu_variants), on_progress)
    except (BuildError, ProbeError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{engine} is ready: {ready.llama_server}")
    click.echo(f"CPU variant: {ready.probe.variant} ({ready.probe.library})")
    dropped = ", ".join(f"{d.variant} ({d.reason})" for d in ready.probe.dropped)
    click.echo(f"dropped: {dropped or 'none'}")
    how = "compiled" if any(phase == "configure" for phase, _ in shown) else "cached; compiled"
    click.echo(f"{how} in {ready.build.record.duration_s:.0f} s with {ready.build.record.compiler}: {ready.build.root}")
