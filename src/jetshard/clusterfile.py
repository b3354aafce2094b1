"""How to reach the cluster `jetshard up` runs: `<data dir>/cluster.json`, read by the client commands.

`up` writes it once the API answers and removes it when it stops cleanly; `jetshard models`, `download`,
`events` and `state` use it when no `--api`/`--nats` (or their environment variables) is given, and send
the API key it records (mode 0600) unless `JETSHARD_API_KEY` names one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

CLUSTER_FILE_NAME = "cluster.json"


def data_dir() -> Path:
    """Where `up` keeps the cluster's history and logs: `JETSHARD_DATA_DIR`, or the XDG data dir."""
    if explicit := os.environ.get("JETSHARD_DATA_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(base) / "jetshard"


def write_cluster_file(
    root: Path, api_url: str, nats_url: str, nats_nkey: Path | None, api_key: str | None = None
) -> None:
    """Record how to reach the cluster; `nats_nkey` is the path of a read-only identity's seed, never a seed.
    The file is 0600: it may hold the API key."""
    path = root / CLUSTER_FILE_NAME
    # Written under another name and renamed, so a reader never sees half a file; created 0600 because it
    # tells where the cluster's credentials are.
    temporary = path.with_name(f".{CLUSTER_FILE_NAME}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(
            {"api": api_url, "nats": nats_url, "nats_nkey": str(nats_nkey) if nats_nkey else None}
            | ({"api_key": api_key} if api_key else {}),
            file,
        )
    os.replace(temporary, path)


def remove_cluster_file(root: Path) -> None:
    (root / CLUSTER_FILE_NAME).unlink(missing_ok=True)


def recorded(kind: Literal["api", "nats", "nats_nkey", "api_key"]) -> str | None:
    """What a running `up` recorded in the data dir (a URL, the path of an nkey seed file, the API key), if any."""
    try:
        value = json.loads((data_dir() / CLUSTER_FILE_NAME).read_text())[kind]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None
