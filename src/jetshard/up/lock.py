"""One `jetshard up` per data directory. A second one on the same directory would start a second nats-server on
the same JetStream store: the two clusters' sequencers take each other's lease, and the store ends up with
both histories and missing blocks. So `up` takes an exclusive lock on `<data dir>/up.lock` before anything
touches the store, and holds it for as long as it runs; each nats-server it starts inherits the lock, so the
store stays locked until the last process that may write it has exited. The kernel drops the lock with its
last holder: a `kill -9` leaves no stale lock. Who holds it is written beside it (`up.holder.json`), for the
refusal a second start prints."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Annotated

import click
import msgspec
from jetshard_bus.procs import pid_alive

LOCK_NAME = "up.lock"
HOLDER_NAME = "up.holder.json"
HOLDER_GONE_WAIT_S = 10.0
"""How long a start waits for the lock while the `up` holding it has died: the kernel sent its nats-server
SIGTERM, which is finishing its writes to the store."""


class Holder(msgspec.Struct, frozen=True):
    """The `jetshard up` that holds a data directory's lock."""

    pid: Annotated[int, msgspec.Meta(gt=0)]
    """A process id: 0 or below would name process groups to `kill`."""
    api: str
    nats: str


def lock_data_dir(root: Path, holder: Holder) -> int:
    """Take `root`'s lock for this process, recording `holder`; the lock's descriptor, which the nats-servers
    started on `root`'s store inherit. Refused (a `click.ClickException` naming the holder) while another
    `up` or a nats-server it started holds it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise click.ClickException(
            f"cannot keep the cluster's data in {root}: {error.strerror}; choose another with --data-dir "
            "(or JETSHARD_DATA_DIR)"
        ) from None
    deadline = time.monotonic() + HOLDER_GONE_WAIT_S
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            other = _recorded_holder(root)
            # Read again on each try: the holder may still be writing its record.
            if other is not None and not pid_alive(other.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            os.close(descriptor)
            raise click.ClickException(_refusal(root, other)) from None
    record = root / HOLDER_NAME
    temporary = record.with_name(f".{HOLDER_NAME}.{os.getpid()}")
    temporary.write_bytes(msgspec.json.encode(holder))
    temporary.replace(record)  # a refused start never reads half a record
    return descriptor


def _recorded_holder(root: Path) -> Holder | None:
    try:
        return msgspec.json.decode((root / HOLDER_NAME).read_bytes(), type=Holder)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _refusal(root: Path, holder: Holder | None) -> str:
    advice = "stop it first, or give this one another --data-dir"
    if holder is None:
        return f"another `jetshard up` is using the data directory {root}: {advice}"
    if pid_alive(holder.pid):
        return (
            f"another `jetshard up` (pid {holder.pid}, API {holder.api}, NATS {holder.nats}) is using the data "
            f"directory {root}: {advice}"
        )
    return (
        f"the nats-server of a `jetshard up` that exited (pid {holder.pid}, NATS {holder.nats}) still holds the "
        f"data directory {root}: stop that nats-server first, or give this one another --data-dir"
    )
