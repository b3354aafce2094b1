"""pytest fixtures pointing the real `huggingface_hub` client at a local `HubServer`.

`huggingface_hub` reads `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE` and the token path into module
constants when it is first imported (and binds the module-level `huggingface_hub.model_info` & co.
to an `HfApi` created at import time). Setting the environment is therefore enough for
subprocesses, but in this process the constants must be patched too: `use_hub()` does both.

`conftest.py` registers this module as a pytest plugin, so its fixtures need no import.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .hub_server import HubServer


def use_hub(url: str, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point huggingface_hub, in this process and in subprocesses, at `url` with an empty `hf_home`.

    Returns the environment variables it set, for subprocesses started with an explicit `env`.
    """
    import importlib

    from huggingface_hub import constants

    # huggingface_hub loads its submodules lazily, so import this one explicitly.
    hf_api = importlib.import_module("huggingface_hub.hf_api")

    hf_home.mkdir(parents=True, exist_ok=True)
    env = {
        "HF_ENDPOINT": url,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        # Never try the Xet protocol: the fake Hub only speaks plain HTTP.
        "HF_HUB_DISABLE_XET": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # A developer's own token must not leak into requests to the fake Hub.
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)

    patched = {
        "ENDPOINT": url,
        "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(hf_home / "hub"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
    }
    for name, value in patched.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    # The module-level HfApi behind `huggingface_hub.model_info` etc. captured the endpoint at import.
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    return env


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A started fake Hub, with huggingface_hub pointed at it and an empty HF_HOME under tmp_path."""
    with HubServer() as server:
        use_hub(server.url, tmp_path / "hf_home", monkeypatch)
        yield server


@pytest.fixture
def hf_env(hub_server: HubServer) -> dict[str, str]:
    """A full environment for a subprocess that should talk to `hub_server` (use_hub set os.environ)."""
    return dict(os.environ)
