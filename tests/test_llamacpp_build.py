"""Where llama.cpp comes from: the build's pure decisions (cache key, progress, the probe's log reading and variant
dropping, the missing-compiler message), then the avx2 build `tests/run` made (`JETSHARD_LLAMA_CPP_CACHE`) probed
for real on this machine, with a variant that dies."""

from __future__ import annotations

import functools
import http.server
import json
import platform
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from jetshard_bus.connect import connect
from jetshard_bus.follower import StateFollower
from jetshard_bus.node import node_profile
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings
from jetshard_schema.events import NodeJoined, NodeUpdated
from jetshard_schema.types import Engine
from jetshard_sequencer.handlers import profile_changed_meaningfully
from jetshard_worker.engines.llamacpp import build as llamacpp_build
from jetshard_worker.engines.llamacpp.build import (
    CACHE_ENV,
    LLAMA_CPP_PYTHON_VERSION,
    SDIST_ENV,
    SDIST_FILENAME,
    BuildError,
    CpuVariants,
    LlamaCppBuild,
    Phase,
    Progress,
    build_key,
    cache_root,
    cached_builds,
    cmake_configure_args,
    compiler_id,
    find_sdist_url,
    find_toolchain,
    index_url,
    missing_tools_message,
    parse_progress,
)
from jetshard_worker.engines.llamacpp.probe import (
    SKIP_VARIANTS_ENV,
    Drop,
    GiveUp,
    ProbeOutcome,
    Served,
    cpu_identity,
    cpu_libraries,
    loaded_cpu_library,
    next_step,
    probe,
    ready_build,
    skipped_variants,
    variant_of,
)

from jetshard.cli import main

# --- pure parts ---------------------------------------------------------------------------------------------


def test_progress_lines_of_make_and_ninja_become_percentages_and_phases() -> None:
    assert parse_progress("[ 43%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o\n") == Progress(
        Phase.COMPILE, 43.0, "Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o"
    )
    assert parse_progress("[100%] Linking CXX executable ../../bin/llama-server") == Progress(
        Phase.LINK, 100.0, "Linking CXX executable ../../bin/llama-server"
    )
    ninja = parse_progress("[12/48] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o")
    assert ninja is not None and ninja.phase is Phase.COMPILE and ninja.percent == 25.0
    assert parse_progress("-- Adding CPU backend variant ggml-cpu-haswell") is None
    assert parse_progress("In file included from ggml.c:1: [-Wfoo]") is None


def test_the_cache_key_separates_versions_compilers_and_variant_choices() -> None:
    keys = {
        build_key("0.3.36", "gcc-12.2.0", "x86_64", CpuVariants.ALL),
        build_key("0.3.36", "gcc-12.2.0", "x86_64", CpuVariants.AVX2),
        build_key("0.3.36", "gcc-13.1.0", "x86_64", CpuVariants.ALL),
        build_key("0.3.37", "gcc-12.2.0", "x86_64", CpuVariants.ALL),
        build_key("0.3.36", "gcc-12.2.0", "aarch64", CpuVariants.ALL),
    }
    assert len(keys) == 5
    assert build_key("0.3.36", "gcc-12.2.0", "x86_64", CpuVariants.AVX2) == (
        "llama-cpp-python-0.3.36-gcc-12.2.0-x86_64-avx2"
    )
    assert "/" not in build_key("0.3.36", "weird/cc 1", "x86_64", CpuVariants.ALL)


def test_the_cache_lives_under_xdg_cache_home_unless_told_otherwise(tmp_path: Path) -> None:
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "jetshard" / "llama.cpp"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path), CACHE_ENV: "/srv/llama"}) == Path("/srv/llama")


@pytest.mark.parametrize(
    ("version_text", "expected"),
    [
        ("c++ (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.\n", "gcc-12.2.0"),
        ("Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu\n", "clang-14.0.6"),
        ("Apple clang version 15.0.0 (clang-1500.3.9.4)\nTarget: arm64-apple-darwin23.4.0\n", "apple-clang-15.0.0"),
    ],
)
def test_the_compiler_is_named_with_its_version(version_text: str, expected: str) -> None:
    assert compiler_id(version_text) == expected


def test_configure_lines_for_all_variants_and_for_avx2(tmp_path: Path) -> None:
    all_args = cmake_configure_args(tmp_path / "src", tmp_path / "build", CpuVariants.ALL, "Linux", "/bin/ninja")
    assert "-DGGML_CPU_ALL_VARIANTS=ON" in all_args and "-DGGML_BACKEND_DL=ON" in all_args
    assert "-DGGML_NATIVE=OFF" in all_args and "-DGGML_RPC=ON" in all_args and "-DLLAMA_OPENSSL=OFF" in all_args
    assert "-DCMAKE_INSTALL_RPATH=$ORIGIN" in all_args and ["-G", "Ninja"] == all_args[4:6]
    avx2 = cmake_configure_args(tmp_path / "src", tmp_path / "build", CpuVariants.AVX2, "Darwin", None)
    assert "-DGGML_CPU_ALL_VARIANTS=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2
    assert "-DCMAKE_INSTALL_RPATH=@loader_path" in avx2 and "-G" not in avx2


def test_a_machine_without_a_compiler_is_told_what_to_install() -> None:
    with pytest.raises(BuildError) as raised:
        find_toolchain({"CC": "no-such-cc", "CXX": "no-such-c++"})
    message = str(raised.value)
    assert "a C compiler (cc)" in message and "a C++ compiler (c++)" in message
    assert "apt-get install build-essential cmake" in message
    assert "jetshard engines build llama.cpp" in message
    assert "xcode-select --install" in missing_tools_message(["cmake"], "Darwin")
    assert "brew install cmake" in missing_tools_message(["cmake"], "Darwin")


def test_the_sdist_is_found_in_json_and_html_index_pages() -> None:
    page_url = "https://mirror.example/simple/llama-cpp-python/"
    listing = {
        "files": [
            {"filename": "llama_cpp_python-0.3.35.tar.gz", "url": "https://files.example/a/old.tar.gz"},
            {"filename": SDIST_FILENAME, "url": "../../packages/ec/e9/" + SDIST_FILENAME},
        ]
    }
    found = find_sdist_url(json.dumps(listing).encode(), "application/vnd.pypi.simple.v1+json", page_url)
    assert found == "https://mirror.example/packages/ec/e9/" + SDIST_FILENAME
    html = f'<a href="https://files.example/p/{SDIST_FILENAME}#sha256=832d">{SDIST_FILENAME}</a>'.encode()
    assert find_sdist_url(html, "text/html", page_url) == f"https://files.example/p/{SDIST_FILENAME}#sha256=832d"
    with pytest.raises(BuildError, match="does not list"):
        find_sdist_url(b'{"files": []}', "application/vnd.pypi.simple.v1+json", page_url)
    assert index_url({}) == "https://pypi.org/simple/"
    assert index_url({"PIP_INDEX_URL": "https://mirror.example/simple"}) == "https://mirror.example/simple/"


def test_the_loaded_cpu_variant_is_read_from_the_servers_log() -> None:
    log = (
        "load_backend: loaded RPC backend from /c/bin/libggml-rpc.so\n"
        "load_backend: loaded CPU backend from /c/bin/libggml-cpu-sapphirerapids.so\n"
        "main: n_parallel is set to auto\n"
    )
    assert loaded_cpu_library(log) == "libggml-cpu-sapphirerapids.so"
    assert loaded_cpu_library("main: loading model\n") is None
    assert variant_of("libggml-cpu-sapphirerapids.so") == "sapphirerapids"
    assert variant_of("libggml-cpu.so") == "cpu"
    assert skipped_variants({SKIP_VARIANTS_ENV: "sapphirerapids, zen4,"}) == {"sapphirerapids", "zen4"}


def test_a_variant_that_dies_by_a_signal_is_dropped_while_another_is_left() -> None:
    libraries = ["libggml-cpu-haswell.so", "libggml-cpu-sapphirerapids.so"]
    sigill = ProbeOutcome(served=False, signal=signal.SIGILL, library="libggml-cpu-sapphirerapids.so")
    assert next_step(sigill, libraries) == Drop(
        "libggml-cpu-sapphirerapids.so", "llama-server died with SIGILL using it"
    )
    assert next_step(ProbeOutcome(served=True, library="libggml-cpu-haswell.so"), libraries) == Served(
        "libggml-cpu-haswell.so"
    )
    last = next_step(sigill, ["libggml-cpu-sapphirerapids.so"])
    assert isinstance(last, GiveUp) and "every CPU variant" in last.reason
    # A death from outside (the OOM killer) or a plain error exit says nothing about the variant.
    killed = next_step(ProbeOutcome(served=False, signal=signal.SIGKILL, library=libraries[1]), libraries)
    assert isinstance(killed, GiveUp) and "SIGKILL" in killed.reason
    failed = ProbeOutcome(served=False, exit_code=1, library=libraries[0], log_tail="failed to load model")
    refused = next_step(failed, libraries)
    assert isinstance(refused, GiveUp) and "exit code 1" in refused.reason and "failed to load model" in refused.reason


def test_the_cpu_key_follows_model_and_flags_not_their_order() -> None:
    xeon = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\n"
    key, description = cpu_identity(xeon, "x86_64")
    assert description == "Intel Xeon"
    assert cpu_identity(xeon.replace("avx2 amx_tile", "amx_tile avx2"), "x86_64")[0] == key
    assert cpu_identity(xeon.replace(" amx_tile", ""), "x86_64")[0] != key
    assert cpu_identity(xeon.replace("Intel Xeon", "AMD EPYC"), "x86_64")[0] != key


def test_an_sdist_that_is_not_the_pinned_one_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    fake = tmp_path / SDIST_FILENAME
    fake.write_bytes(b"not the sdist")
    cache = tmp_path / "cache"
    with pytest.raises(BuildError, match="is not the pinned"):
        llamacpp_build.build(CpuVariants.AVX2, environ={CACHE_ENV: str(cache), SDIST_ENV: str(fake)})
    assert [path.name for path in cache.iterdir() if path.is_dir()] == []


def test_the_sdist_comes_from_the_mirror_pip_uses_and_is_checked_after_download(tmp_path: Path) -> None:
    """A mirror (PIP_INDEX_URL) serving its PEP 503 page and a file that is not the pinned sdist: downloaded with
    progress, then refused by its sha256, leaving nothing in the cache."""
    (tmp_path / "simple" / "llama-cpp-python").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / SDIST_FILENAME).write_bytes(b"x" * 3_000_000)
    page = f'<html><body><a href="../../files/{SDIST_FILENAME}#sha256=00">{SDIST_FILENAME}</a></body></html>'
    (tmp_path / "simple" / "llama-cpp-python" / "index.html").write_text(page)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen: list[Progress] = []
    cache = tmp_path / "cache"
    try:
        environ = {CACHE_ENV: str(cache), "PIP_INDEX_URL": f"http://127.0.0.1:{server.server_port}/simple"}
        with pytest.raises(BuildError, match="is not the pinned") as raised:
            llamacpp_build.build(CpuVariants.AVX2, seen.append, environ)
    finally:
        server.shutdown()
        server.server_close()
    assert f"http://127.0.0.1:{server.server_port}/files/{SDIST_FILENAME}" in str(raised.value)
    downloads = [p for p in seen if p.phase is Phase.DOWNLOAD]
    assert downloads and downloads[-1].percent == 100.0
    assert [path.name for path in cache.iterdir() if path.is_dir()] == []


# --- the real build -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def avx2_build() -> LlamaCppBuild:
    """The avx2 build `tests/run` made or found in `JETSHARD_LLAMA_CPP_CACHE`; the suite never compiles one."""
    builds = [b for b in cached_builds() if b.record.cpu_variants is CpuVariants.AVX2]
    assert builds, f"no llama.cpp avx2 build in {cache_root()}: `bash tests/run` builds it before the tests"
    return builds[0]


@pytest.fixture
def build_copy(avx2_build: LlamaCppBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LlamaCppBuild:
    """A copy of the build in a cache of this test's own, never probed: what a fresh machine sharing it sees."""
    cache = tmp_path / "cache"
    shutil.copytree(avx2_build.root, cache / avx2_build.root.name, symlinks=True)
    (cache / avx2_build.root.name / "probe.json").unlink(missing_ok=True)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return LlamaCppBuild(cache / avx2_build.root.name, avx2_build.record)


def test_the_build_carries_its_binaries_and_one_cpu_library(avx2_build: LlamaCppBuild) -> None:
    assert avx2_build.record.llama_cpp_python_version == LLAMA_CPP_PYTHON_VERSION
    for binary in (avx2_build.llama_server, avx2_build.rpc_server, avx2_build.llama_quantize):
        # The binaries find their libraries beside them, wherever the cache is.
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        assert "not found" not in ldd, ldd
    assert cpu_libraries(avx2_build) == ["libggml-cpu.so"]


def _llama_cpp_status() -> dict[str, Any]:
    answer = CliRunner().invoke(main, ["engines", "status", "--json"])
    assert answer.exit_code == 0, answer.output
    return next(engine for engine in json.loads(answer.output) if engine["engine"] == "llama.cpp")


def test_a_fresh_build_is_ready_only_once_probed_on_this_cpu(build_copy: LlamaCppBuild) -> None:
    assert ready_build() is None
    assert _llama_cpp_status()["ready"] is False
    passed = probe(build_copy)
    assert passed.library == "libggml-cpu.so" and passed.dropped == []
    ready = ready_build()
    assert ready is not None and ready.llama_server == build_copy.llama_server and ready.probe == passed
    assert ready.bin_dir == build_copy.root / "bin"
    status = _llama_cpp_status()
    assert status["ready"] is True and status["variant"] == "cpu" and status["dropped"] == []
    assert status["llama_server"] == str(build_copy.llama_server)


def _die_after_loading(tmp_path: Path, bin_dir: Path) -> None:
    """A CPU variant that scores above every other and, once loaded (once its server logged so), dies with SIGILL:
    what gcc 12's sapphirerapids library does on a Xeon with AMX."""
    source = tmp_path / "dying.c"
    source.write_text(
        r"""
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int ggml_backend_score(void) { return 1 << 30; }
static void *die_once_logged(void *unused) {
    (void)unused;
    char line[4096];
    for (;;) {  /* the server's log is its stdout: die once it names this library */
        FILE *log = fopen("/proc/self/fd/1", "r");
        int logged = 0;
        while (log && fgets(line, sizeof line, log))
            if (strstr(line, "libggml-cpu-dying.so")) logged = 1;
        if (log) fclose(log);
        if (logged) raise(SIGILL);
        usleep(10000);
    }
    return 0;
}
void *ggml_backend_init(void) {
    Dl_info self;
    dladdr((void *)ggml_backend_score, &self);
    char path[4096];
    snprintf(path, sizeof path, "%s", self.dli_fname);
    strcpy(strrchr(path, '/') + 1, "libggml-cpu.so");
    void *real = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    void *(*init)(void) = (void *(*)(void))dlsym(real, "ggml_backend_init");
    pthread_t thread;
    pthread_create(&thread, 0, die_once_logged, 0);
    return init();
}
"""
    )
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(bin_dir / "libggml-cpu-dying.so"), str(source), "-ldl", "-lpthread"],
        check=True,
    )


def test_a_variant_that_dies_is_moved_aside_and_the_next_one_serves(build_copy: LlamaCppBuild, tmp_path: Path) -> None:
    _die_after_loading(tmp_path, build_copy.bin_dir)
    passed = probe(build_copy)
    assert passed.library == "libggml-cpu.so"
    assert [(d.variant, d.reason) for d in passed.dropped] == [("dying", "llama-server died with SIGILL using it")]
    assert (build_copy.bin_dir / "disabled" / "libggml-cpu-dying.so").is_file()
    assert cpu_libraries(build_copy) == ["libggml-cpu.so"]
    ready = ready_build()
    assert ready is not None and ready.probe == passed


def test_a_variant_named_in_the_skip_switch_is_never_tried(
    build_copy: LlamaCppBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _die_after_loading(tmp_path, build_copy.bin_dir)
    monkeypatch.setenv(SKIP_VARIANTS_ENV, "dying")
    passed = probe(build_copy)
    assert [(d.variant, d.reason) for d in passed.dropped] == [("dying", f"named in {SKIP_VARIANTS_ENV}")]
    assert passed.library == "libggml-cpu.so"


# --- the worker ---------------------------------------------------------------------------------------------


def test_a_node_that_gains_an_engine_is_a_change_the_sequencer_records() -> None:
    before = node_profile()
    assert profile_changed_meaningfully(before, msgspec.structs.replace(before, engines=(Engine.MLX, Engine.LLAMA_CPP)))


async def test_a_worker_serves_on_mlx_while_it_readies_llama_cpp_then_reports_it(
    fresh_nats, processes, build_copy: LlamaCppBuild, tmp_path: Path
) -> None:
    """A node whose cache holds a build not yet probed here joins with MLX alone, probes in the background and
    reports llama.cpp; restarted, it joins with llama.cpp at once."""
    client, js = await connect(NatsOptions(servers=(fresh_nats.url,)), "test", BusTimings())
    engines_seen: list[tuple[Engine, ...]] = []
    follower = StateFollower(js)

    def record(envelope, state, live) -> None:  # type: ignore[no-untyped-def]
        if isinstance(envelope.event, NodeJoined | NodeUpdated):
            engines_seen.append(envelope.event.profile.engines)

    follower.add_listener(record)
    await follower.start()
    env = {
        "JETSHARD_CONFIG_DIR": str(tmp_path / "cfg"),
        CACHE_ENV: str(build_copy.root.parent),
        "JETSHARD_BUILD_LLAMA_CPP": "1",
        "JETSHARD_LLAMA_CPP_CPU_VARIANTS": "avx2",
    }
    try:
        processes.start("seq", "sequencer", "--nats", fresh_nats.url)
        worker = processes.start("w1", "worker", "--nats", fresh_nats.url, env=env)
        await follower.wait_until(lambda s: any(Engine.LLAMA_CPP in e for e in engines_seen), 120)
        assert engines_seen[0] == (Engine.MLX,), engines_seen
        assert "llama.cpp is ready" in processes.log("w1")
        assert (build_copy.root / "probe.json").is_file()

        processes.kill(worker, signal.SIGTERM)
        engines_seen.clear()
        processes.start("w2", "worker", "--nats", fresh_nats.url, env=env)
        await follower.wait_until(lambda s: bool(engines_seen), 60)
        assert engines_seen[0] == (Engine.MLX, Engine.LLAMA_CPP)
        assert "building llama.cpp" not in processes.log("w2")
    finally:
        await follower.stop()
        await client.close()


def test_a_build_under_way_shows_how_far_it_has_got_to_engines_and_up(tmp_path: Path) -> None:
    """While the worker compiles llama.cpp in the background, `jetshard engines` and `jetshard up` say so and how far
    it got (its log's last step, however much compiler output follows it), instead of offering to compile it again,
    and `up` says when it is ready; a build nobody runs any more (a killed one's leftover `.partial`) is no build
    under way."""
    import fcntl

    from jetshard.commands.engines import llama_cpp_hint, llama_cpp_ready_line

    environ = {"JETSHARD_LLAMA_CPP_CACHE": str(tmp_path)}
    key = "llama-cpp-python-0.3.36-gcc-12.2.0-x86_64-all"
    (tmp_path / f"{key}.partial").mkdir()
    # The last step's line, then megabytes of warnings, as gcc writes them on the vendored sources.
    warning = "ops.cpp:10139:25: warning: 'sum' may be used uninitialized [-Wmaybe-uninitialized]\n"
    (tmp_path / f"{key}.log").write_text(
        "-- Configuring done\n[ 12%] Building C object a.o\n[ 43%] Building CXX object b.o\n" + warning * 40_000
    )
    assert llamacpp_build.builds_under_way(environ) == []  # left by a killed build: its lock is free
    with open(tmp_path / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the building process holds it
        (under_way,) = llamacpp_build.builds_under_way(environ)
        assert under_way.key == key and under_way.progress is not None and under_way.progress.percent == 43
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("JETSHARD_LLAMA_CPP_CACHE", str(tmp_path))
            listed = CliRunner().invoke(main, ["engines"], terminal_width=200)
            hint = llama_cpp_hint(build_allowed=True)
            assert llama_cpp_ready_line() is None
        assert listed.exit_code == 0 and "compile 43%" in listed.output, listed.output
        assert hint is not None and hint.building and "compiling in the background (compile 43%" in hint.text
    # Once a build has passed its probe here (the suite's own), `up` says that models now move to it.
    ready = llama_cpp_ready_line()
    assert ready is not None and ready.startswith("llama.cpp is built (CPU variant "), ready


FAKE_TREE_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(stand_in NONE)
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
foreach(name llama-server ggml-rpc-server llama-quantize)
  add_custom_target(${name} ALL COMMAND ${CMAKE_COMMAND} -E touch ${CMAKE_BINARY_DIR}/bin/${name})
endforeach()
"""


def test_a_build_stopped_part_way_goes_on_from_its_tree_and_one_that_fails_again_starts_afresh(tmp_path: Path) -> None:
    """`jetshard up` stopped while its worker compiles: the next build resumes from the checked, extracted tree (no
    download, objects kept); a resumed build that fails leaves nothing, so the one after starts clean. A stand-in
    CMake project takes llama.cpp's place (compiling it takes minutes)."""
    environ = {"JETSHARD_LLAMA_CPP_CACHE": str(tmp_path / "cache"), "JETSHARD_LLAMA_CPP_SDIST": str(tmp_path / "none")}
    key = build_key(LLAMA_CPP_PYTHON_VERSION, find_toolchain().compiler, platform.machine().lower(), CpuVariants.AVX2)
    partial = tmp_path / "cache" / f"{key}.partial"
    tree = partial / "src" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(FAKE_TREE_CMAKE)
    (partial / "build").mkdir()
    (partial / llamacpp_build.EXTRACTED_MARK).write_text(str(tree))
    (tmp_path / "cache" / f"{key}.log").write_text("[ 40%] Building CXX object before-the-stop.o\n")

    def worker_gone(progress: Progress) -> None:
        raise BrokenPipeError("the worker reading the build's progress died")

    with pytest.raises(BrokenPipeError):
        llamacpp_build.build(CpuVariants.AVX2, worker_gone, environ=environ)
    assert (partial / llamacpp_build.EXTRACTED_MARK).is_file()  # stopped, not failed: kept for the next build
    done = llamacpp_build.build(CpuVariants.AVX2, environ=environ)  # no sdist anywhere: it must not fetch one
    assert {p.name for p in done.bin_dir.iterdir()} >= {"llama-server", "ggml-rpc-server", "llama-quantize"}
    assert not partial.exists()
    assert "before-the-stop.o" in (tmp_path / "cache" / f"{key}.log").read_text()  # one log across both runs
    shutil.rmtree(done.root)
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text('cmake_minimum_required(VERSION 3.16)\\nmessage(FATAL_ERROR "broken")\\n')
    (partial / llamacpp_build.EXTRACTED_MARK).write_text(str(tree))
    with pytest.raises(BuildError):
        llamacpp_build.build(CpuVariants.AVX2, environ=environ)
    assert not partial.exists()
