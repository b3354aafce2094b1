"""How a downloader runs, as `jetshard downloader` sets it: a flag per field whose `msgspec.Meta` gives its help.
Kept apart from the service so that the command line reads it without loading the downloader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from jetshard_bus.node import config_dir
from jetshard_bus.options import NatsOptions
from jetshard_bus.streams import BusTimings

from jetshard_downloader.dirs import ModelDirs


@dataclass(frozen=True)
class DownloaderConfig:
    nats: NatsOptions = NatsOptions()
    timings: BusTimings = BusTimings()
    config_dir: Path = field(default_factory=config_dir)
    model_dirs: ModelDirs = field(default_factory=ModelDirs.from_env)
    storage_interval_s: float = 10.0
    offline: Annotated[
        bool, msgspec.Meta(description="make no network call (also HF_HUB_OFFLINE=1)", extra={"switch": True})
    ] = False
    """Also on with JETSHARD_OFFLINE=1."""
    progress_interval_s: float = 1.0
    """At most one progress report per model per this many seconds."""
    endpoint: str | None = None
    """The Hub (default: HF_ENDPOINT, else huggingface.co)."""
    token: str | bool | None = None
    retry_backoff_s: tuple[float, ...] = (2.0, 4.0, 8.0)
    """Waits before each retry of a download that failed mid-transfer; one retry per entry. A Hub that
    cannot be reached at all, refuses, or lacks the model is not retried: its instance fails at once."""
    advertise_host: Annotated[
        str | None,
        msgspec.Meta(
            description="address other nodes reach this node's file server on [default: the address used to reach NATS]"
        ),
    ] = None
    """The file server also listens on it: loopback where NATS is on this machine alone."""
    file_server_port: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=65535,
            description="the port of the file server other nodes' downloaders copy model files from (mutual TLS; 0: "
            "any free port)",
        ),
    ] = 0
    """The port chosen is named in the node's storage report."""
    peer_copies: Annotated[
        bool,
        msgspec.Meta(
            description="copy model files from the nodes that hold them before asking the Hub, and serve ours to them"
        ),
    ] = True
