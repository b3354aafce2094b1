"""Shared fixtures: temporary homes here; processes, nats-servers and clusters in `helpers.harness`; the fake
Hub in `helpers.hub_fixtures`; tiny GGUF models in `helpers.gguf_fixtures`."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "helpers.hub_fixtures",
    "helpers.harness",
    "helpers.dialects",
    "helpers.llamacpp_cluster",
    "helpers.gguf_fixtures",
]


def pytest_configure() -> None:
    # A suite started in the background (`cmd &`, as CI may start it) has SIGINT ignored, and so would every child it
    # starts: Python makes no KeyboardInterrupt of a SIGINT that was ignored when it started, so a test's Ctrl-C on a
    # command would go unheard. Take SIGINT back as a run in a terminal has it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No test reads or writes the real HOME, XDG dirs or Hugging Face cache."""
    home = tmp_path_factory.mktemp("home")
    saved = dict(os.environ)
    os.environ.update(
        {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "HF_HOME": str(home / ".cache/huggingface"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            # Runners must compute exactly what in-process mlx_lm does for the equality tests.
            "JETSHARD_BLAS": "0",
            # Workers find the llama.cpp build `tests/run` made (JETSHARD_LLAMA_CPP_CACHE) and never compile one.
            "JETSHARD_BUILD_LLAMA_CPP": "0",
        }
    )
    for name in ("HF_HUB_OFFLINE", "JETSHARD_OFFLINE", "HF_TOKEN"):
        os.environ.pop(name, None)
    yield home
    os.environ.clear()
    os.environ.update(saved)
