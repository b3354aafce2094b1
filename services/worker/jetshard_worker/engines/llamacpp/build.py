"""Where llama.cpp comes from: upstream `llama-server`, `ggml-rpc-server` and `llama-quantize`, compiled once from
the llama.cpp tree vendored in PyPI's `llama-cpp-python` sdist (pinned by version and sha256) and cached under
`$XDG_CACHE_HOME/jetshard/llama.cpp/<key>/` (or `JETSHARD_LLAMA_CPP_CACHE`), one directory per version, compiler
and CPU-variants choice. `probe` then checks the result on this CPU; `ready_build` finds a build that passed.

cmake and ninja come from PyPI as the worker's own dependencies (the `cmake` and `ninja` wheels), so a fresh machine
with pip needs only a C/C++ compiler: Debian's `cmake` is not in build-essential, and ninja schedules the compile
better than make. A cmake or ninja on PATH serves too, when the wheels' are missing.

`python -m jetshard_worker.engines.llamacpp` (its `__main__`) builds and probes, printing each progress step as a JSON
line: how the worker runs it in the background, `nice`d.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import msgspec

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The `llama-cpp-python` release whose vendored llama.cpp tree is built: one pinned llama.cpp version."""
SDIST_FILENAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
DEFAULT_INDEX_URL = "https://pypi.org/simple/"
SDIST_ENV = "JETSHARD_LLAMA_CPP_SDIST"
"""A local copy of the sdist to build from instead of downloading it (its sha256 is checked all the same)."""
CACHE_ENV = "JETSHARD_LLAMA_CPP_CACHE"
"""The directory that holds the builds, instead of `$XDG_CACHE_HOME/jetshard/llama.cpp`."""

LLAMA_SERVER = "llama-server"
RPC_SERVER = "ggml-rpc-server"
LLAMA_QUANTIZE = "llama-quantize"
TARGETS = (LLAMA_SERVER, RPC_SERVER, LLAMA_QUANTIZE)
BUILD_RECORD = "build.json"
EXTRACTED_MARK = "extracted"
"""In `<key>.partial`: the path of the checked sdist's extracted tree, written once it is whole."""

_DOWNLOAD_CHUNK_BYTES = 1 << 20


class CpuVariants(enum.StrEnum):
    """Which CPU code a build carries: ggml picks the best library it can run at load time (GGML_BACKEND_DL)."""

    ALL = "all"
    """ggml's whole list for this architecture (on x86: 14 libraries, from SSE4.2 to AMX): the fastest on every
    CPU, the longest to compile."""
    AVX2 = "avx2"
    """x86 only: one AVX2/FMA/F16C library, which every x86 machine of the last ten years runs; a few times faster
    to compile (CI, tests), somewhat slower on AVX-512 machines."""


class Phase(enum.StrEnum):
    DOWNLOAD = "download"
    EXTRACT = "extract"
    CONFIGURE = "configure"
    COMPILE = "compile"
    LINK = "link"
    INSTALL = "install"
    PROBE = "probe"
    READY = "ready"


class Progress(msgspec.Struct, frozen=True):
    phase: Phase
    percent: float | None = None
    """Of this phase, where known."""
    detail: str = ""


ProgressCallback = Callable[[Progress], None]


class BuildError(Exception):
    """A build that cannot be made here; the message says why and what to do."""


class BuildRecord(msgspec.Struct, frozen=True, kw_only=True):
    """`build.json` in a build's directory: what it was built from, written last, so its presence means complete."""

    llama_cpp_python_version: str
    cpu_variants: CpuVariants
    compiler: str
    machine: str
    cmake_args: list[str]
    duration_s: float


@dataclass(frozen=True)
class LlamaCppBuild:
    """A complete build in the cache: executables and every library they load side by side in `bin_dir` (the
    binaries find their libraries through an `$ORIGIN` rpath; ggml loads CPU variants from the executable's
    directory, and from the current directory: run them from elsewhere than a build's `bin`)."""

    root: Path
    record: BuildRecord

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def llama_server(self) -> Path:
        return self.bin_dir / LLAMA_SERVER

    @property
    def rpc_server(self) -> Path:
        return self.bin_dir / RPC_SERVER

    @property
    def llama_quantize(self) -> Path:
        return self.bin_dir / LLAMA_QUANTIZE

    @property
    def lock_path(self) -> Path:
        return self.root.parent / f"{self.root.name}.lock"


# --- pure parts ---------------------------------------------------------------------------------------------


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    if explicit := environ.get(CACHE_ENV):
        return Path(explicit).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jetshard" / "llama.cpp"


def build_key(version: str, compiler: str, machine: str, variants: CpuVariants) -> str:
    """The cache directory's name: one build per llama.cpp version, compiler, architecture and variants choice."""
    safe_compiler = re.sub(r"[^A-Za-z0-9.+_-]", "_", compiler)
    return f"llama-cpp-python-{version}-{safe_compiler}-{machine.lower()}-{variants.value}"


def compiler_id(version_text: str) -> str:
    """`c++ --version`'s output → `gcc-12.2.0`, `clang-14.0.6`, `apple-clang-15.0.0`."""
    first_line = version_text.strip().splitlines()[0] if version_text.strip() else ""
    if "clang" in first_line:
        name = "apple-clang" if first_line.startswith("Apple") else "clang"
        match = re.search(r"version (\d+(?:\.\d+)+)", first_line)
    else:
        name = "gcc" if re.search(r"\b(gcc|g\+\+|GCC)\b|Free Software Foundation", version_text) else "cc"
        match = None
    versions = re.findall(r"\b\d+(?:\.\d+)+\b", first_line)
    version = match.group(1) if match else (versions[-1] if versions else "unknown")
    return f"{name}-{version}"


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i686", "i386")


def cmake_configure_args(
    tree: Path, build_dir: Path, variants: CpuVariants, system: str, ninja: str | None
) -> list[str]:
    """The configure arguments after `cmake`: shared libraries with dynamically loaded CPU variants (so one build
    serves an AVX2-only machine and an AVX-512 one), RPC on, tests, examples, the web UI and downloads off, and an
    rpath relative to the binaries so the directory can be moved into the cache."""
    origin = "@loader_path" if system == "Darwin" else "$ORIGIN"
    args = ["-S", str(tree), "-B", str(build_dir)]
    if ninja:
        args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    args += [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        f"-DCMAKE_INSTALL_RPATH={origin}",
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_NATIVE=OFF",
        "-DGGML_RPC=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]
    if variants is CpuVariants.ALL:
        args.append("-DGGML_CPU_ALL_VARIANTS=ON")
    else:
        # ggml's CMake makes `ggml` depend on every variant library, so a subset cannot be built by target: one
        # library at the AVX2 level instead, which all our x86 machines run (AVX2-only EPYCs, AVX-512 Xeons).
        args += ["-DGGML_CPU_ALL_VARIANTS=OFF"]
        args += [f"-DGGML_{flag}=ON" for flag in ("AVX", "AVX2", "FMA", "F16C", "BMI2")]
    return args


_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]\s*(.*)$")
_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")


def parse_progress(line: str) -> Progress | None:
    """A compile step from the build's output: make's `[ 43%] Building CXX object …` or ninja's
    `[12/345] Building CXX object …`; None for any other line."""
    line = line.strip()
    if match := _MAKE_PROGRESS.match(line):
        percent, detail = float(match.group(1)), match.group(2)
    elif match := _NINJA_PROGRESS.match(line):
        done, total = int(match.group(1)), int(match.group(2))
        percent, detail = 100.0 * done / max(total, 1), match.group(3)
    else:
        return None
    phase = Phase.LINK if detail.startswith("Linking") else Phase.COMPILE
    return Progress(phase, percent, detail)


def missing_tools_message(missing: Sequence[str], system: str) -> str:
    """What a user without a compiler (or cmake) must install to build llama.cpp, for their system."""
    if system == "Darwin":
        install = "xcode-select --install && brew install cmake"
    else:
        install = "sudo apt-get install build-essential cmake (Debian, Ubuntu); sudo dnf install gcc-c++ cmake (Fedora)"
    return (
        f"llama.cpp is compiled here once, and this machine lacks {', '.join(missing)}. Install them: {install}; "
        f"then run `jetshard engines build llama.cpp`"
    )


def find_sdist_url(page: bytes, content_type: str, page_url: str) -> str:
    """The sdist's URL from a package's simple-index page (PEP 691 JSON, or PEP 503 HTML from older mirrors)."""
    if "json" in content_type:
        for entry in json.loads(page).get("files", []):
            if entry.get("filename") == SDIST_FILENAME:
                return urllib.parse.urljoin(page_url, entry["url"])
    else:
        for href in re.findall(r'href="([^"]+)"', page.decode("utf-8", "replace")):
            if urllib.parse.urlsplit(href).path.rsplit("/", 1)[-1] == SDIST_FILENAME:
                return urllib.parse.urljoin(page_url, href.replace("&amp;", "&"))
    raise BuildError(f"{page_url} does not list {SDIST_FILENAME}")


def index_url(environ: Mapping[str, str] = os.environ) -> str:
    """The package index pip or uv would use: a mirror where one is set, else PyPI."""
    url = environ.get("PIP_INDEX_URL") or environ.get("UV_INDEX_URL") or environ.get("UV_DEFAULT_INDEX")
    return (url or DEFAULT_INDEX_URL).rstrip("/") + "/"


# --- the toolchain ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolchain:
    cmake: str
    ninja: str | None
    c_compiler: str
    cxx_compiler: str
    compiler: str
    """`compiler_id` of the C++ compiler: part of the cache key."""


def _tool(name: str) -> str | None:
    """A tool from this environment's scripts (where the cmake and ninja wheels put theirs), else from PATH."""
    scripts = Path(sysconfig.get_path("scripts"))
    for directory in (scripts, Path(sys.executable).parent):
        if (directory / name).is_file() and os.access(directory / name, os.X_OK):
            return str(directory / name)
    return shutil.which(name)


def find_toolchain(environ: Mapping[str, str] = os.environ) -> Toolchain:
    cmake = _tool("cmake")
    c_compiler = shutil.which(environ.get("CC") or "cc")
    cxx_compiler = shutil.which(environ.get("CXX") or "c++")
    missing = [
        name
        for name, found in (("cmake", cmake), ("a C compiler (cc)", c_compiler), ("a C++ compiler (c++)", cxx_compiler))
        if not found
    ]
    if missing or cmake is None or c_compiler is None or cxx_compiler is None:
        raise BuildError(missing_tools_message(missing, platform.system()))
    version = subprocess.run([cxx_compiler, "--version"], capture_output=True, text=True, check=False).stdout
    return Toolchain(cmake, _tool("ninja"), c_compiler, cxx_compiler, compiler_id(version))


# --- the build ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Held while one process builds or probes a build: a second waits, then finds the first one's result."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class BuildUnderWay(msgspec.Struct, frozen=True):
    """A build another process is compiling now (its `<key>.partial` exists and its lock is held)."""

    key: str
    progress: Progress | None
    """How far it has got, by the last step its log names."""


def builds_under_way(environ: Mapping[str, str] = os.environ) -> list[BuildUnderWay]:
    """The builds being compiled now, by any process on this machine (the worker's background build, a `jetshard
    engines build`), each with its progress: what `jetshard engines` and `jetshard up` show while one runs."""
    root = cache_root(environ)
    return [
        BuildUnderWay(key, _last_progress(root / f"{key}.log"))
        for partial in sorted(root.glob("*.partial"))
        if _held(root / f"{(key := partial.name.removesuffix('.partial'))}.lock")
    ]


def _held(lock_path: Path) -> bool:
    try:
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def _last_progress(log_path: Path, block_bytes: int = 1 << 16) -> Progress | None:
    """The last step the log names, read back from its end a block at a time: gcc's warnings on the vendored
    sources fill megabytes between two steps of the all-variants build."""
    try:
        with open(log_path, "rb") as log:
            end, cut_line = log.seek(0, os.SEEK_END), b""
            while end > 0:
                start = max(0, end - block_bytes)
                log.seek(start)
                lines = (log.read(end - start) + cut_line).split(b"\n")
                cut_line = lines.pop(0) if start > 0 else b""  # its start is in the block before
                for line in reversed(lines):
                    if (progress := parse_progress(line.decode(errors="replace"))) is not None:
                        return progress
                end = start
    except OSError:
        pass
    return None


def read_build(root: Path) -> LlamaCppBuild | None:
    """The complete build at `root`, or None."""
    try:
        record = msgspec.json.decode((root / BUILD_RECORD).read_bytes(), type=BuildRecord)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return None
    build = LlamaCppBuild(root, record)
    return (
        build if all(path.is_file() for path in (build.llama_server, build.rpc_server, build.llama_quantize)) else None
    )


def cached_builds(environ: Mapping[str, str] = os.environ) -> list[LlamaCppBuild]:
    """The complete builds of the pinned version for this architecture, `all` before `avx2`."""
    root = cache_root(environ)
    builds = [build for path in sorted(root.glob("*/")) if (build := read_build(path)) is not None]
    order = list(CpuVariants)
    return sorted(
        (
            build
            for build in builds
            if build.record.llama_cpp_python_version == LLAMA_CPP_PYTHON_VERSION
            and build.record.machine == platform.machine().lower()
        ),
        key=lambda build: order.index(build.record.cpu_variants),
    )


def build(
    variants: CpuVariants = CpuVariants.ALL,
    on_progress: ProgressCallback = lambda _: None,
    environ: Mapping[str, str] = os.environ,
) -> LlamaCppBuild:
    """The build for `variants` with this machine's compiler: from the cache, else compiled now (minutes to tens
    of minutes). Compiled into `<key>.partial` and renamed into place when complete, so a killed build leaves no
    half a cache; a lock keeps two builds of one key from running at once. A build stopped part way (`jetshard up`
    stopped while its worker compiled) goes on where it stopped the next time: its checked, extracted tree and its
    compiled objects stay in `<key>.partial` (ninja recompiles what it had not finished); a build that fails leaves
    nothing, and the next starts afresh."""
    machine = platform.machine().lower()
    if variants is CpuVariants.AVX2 and not is_x86(machine):
        raise BuildError(f"--cpu-variants avx2 is for x86 machines; this one is {machine}: use all")
    toolchain = find_toolchain(environ)
    root = cache_root(environ)
    key = build_key(LLAMA_CPP_PYTHON_VERSION, toolchain.compiler, machine, variants)
    target = root / key
    with locked(root / f"{key}.lock"):
        if (done := read_build(target)) is not None:
            return done
        shutil.rmtree(target, ignore_errors=True)  # a directory without its record is not a build
        partial = root / f"{key}.partial"
        extracted = partial / EXTRACTED_MARK
        resumed = extracted.is_file()  # left by a build that stopped: the lock says none runs now
        started = time.monotonic()
        try:
            if resumed:
                tree = Path(extracted.read_text())
            else:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                sdist = _sdist(partial, on_progress, environ)
                on_progress(Progress(Phase.EXTRACT, detail=str(sdist)))
                tree = _extract_tree(sdist, partial / "src")
                extracted.write_text(str(tree))
            build_dir = partial / "build"
            args = cmake_configure_args(tree, build_dir, variants, platform.system(), toolchain.ninja)
            args += [f"-DCMAKE_C_COMPILER={toolchain.c_compiler}", f"-DCMAKE_CXX_COMPILER={toolchain.cxx_compiler}"]
            log_path = root / f"{key}.log"
            with open(log_path, "a" if resumed else "w") as log:
                on_progress(Progress(Phase.CONFIGURE, detail=" ".join(["cmake", *args])))
                _run([toolchain.cmake, *args], log, log_path, on_progress)
                jobs = str(os.cpu_count() or 1)
                _run(
                    [toolchain.cmake, "--build", str(build_dir), "-j", jobs, "--target", *TARGETS],
                    log,
                    log_path,
                    on_progress,
                )
            on_progress(Progress(Phase.INSTALL, detail=str(target)))
            out = partial / "out"
            _install(build_dir / "bin", out / "bin")
            record = BuildRecord(
                llama_cpp_python_version=LLAMA_CPP_PYTHON_VERSION,
                cpu_variants=variants,
                compiler=toolchain.compiler,
                machine=machine,
                cmake_args=args,
                duration_s=round(time.monotonic() - started, 1),
            )
            (out / BUILD_RECORD).write_bytes(msgspec.json.format(msgspec.json.encode(record)))
            out.rename(target)
        except BuildError:
            # A build that fails leaves nothing (what was left may be what fails): the next starts afresh. One that
            # was only stopped (its worker gone: the progress pipe broken; Ctrl-C) keeps what it made.
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(partial, ignore_errors=True)
    result = read_build(target)
    assert result is not None, f"{target} was just built"
    return result


def _sdist(partial: Path, on_progress: ProgressCallback, environ: Mapping[str, str]) -> Path:
    """The pinned sdist, checked against its sha256: the local copy `JETSHARD_LLAMA_CPP_SDIST` names, else
    downloaded from the package index."""
    if local := environ.get(SDIST_ENV):
        path = Path(local).expanduser()
        _check_sha256(path, _sha256_of(path), path)
        return path
    page_url = index_url(environ) + "llama-cpp-python/"
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    request = urllib.request.Request(page_url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            url = find_sdist_url(response.read(), response.headers.get("Content-Type", ""), page_url)
        path = partial / SDIST_FILENAME
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as file:
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            while chunk := response.read(_DOWNLOAD_CHUNK_BYTES):
                file.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                on_progress(Progress(Phase.DOWNLOAD, 100.0 * done / total if total else None, url))
    except OSError as error:
        raise BuildError(
            f"could not download {SDIST_FILENAME} from {page_url}: {error} (set {SDIST_ENV} to a local copy)"
        ) from error
    _check_sha256(path, digest.hexdigest(), url)
    return path


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_DOWNLOAD_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, actual: str, origin: Path | str) -> None:
    if actual != SDIST_SHA256:
        raise BuildError(f"{origin} is not the pinned {SDIST_FILENAME}: sha256 {actual}, expected {SDIST_SHA256}")


def _extract_tree(sdist: Path, destination: Path) -> Path:
    """Only the vendored llama.cpp tree of the sdist."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist, "r:gz") as archive:
        members = [member for member in archive.getmembers() if member.name.startswith(prefix)]
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later: no links or paths out of `destination`
            archive.extractall(destination, members=members, filter="data")
        else:
            archive.extractall(destination, members=members)  # the archive is the pinned one: its sha256 was checked
    return destination / prefix


def _run(command: list[str], log: TextIO, log_path: Path, on_progress: ProgressCallback) -> None:
    """Run a cmake step, its output into the build's log and its progress lines to `on_progress`."""
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1
    )
    assert process.stdout is not None
    for line in process.stdout:
        log.write(line)
        if (progress := parse_progress(line)) is not None:
            on_progress(progress)
    if (code := process.wait()) != 0:
        log.flush()
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise BuildError(f"`{' '.join(command[:2])} …` failed (exit {code}); its log is {log_path}:\n{tail}")


def _install(built: Path, bin_dir: Path) -> None:
    """The three executables and every shared library beside them (links kept as links)."""
    bin_dir.mkdir(parents=True)
    for name in TARGETS:
        if not (built / name).is_file():
            raise BuildError(f"the build made no {name} in {built}")
        shutil.copy2(built / name, bin_dir / name)
    for library in built.iterdir():
        if library.name.startswith("lib") and re.search(r"\.(so|dylib)(\.|$)", library.name):
            shutil.copy2(library, bin_dir / library.name, follow_symlinks=False)
