"""An nkey identity's own inbox: every reply to the identity comes there, and only it may subscribe to it (the
server's permissions, `jetshard up`'s `auth.py`), so no identity reads the replies meant for another."""

from __future__ import annotations

from pathlib import Path

import nkeys

INBOX_PREFIX = "_INBOX"


def inbox_prefix(public_key: str) -> str:
    """Where the replies to the identity with `public_key` come: its inbox, which only it may subscribe to."""
    return f"{INBOX_PREFIX}.{public_key}"


class NotASeedError(ValueError):
    """A file given as an nkey seed holds none."""


def public_key_of(seed_file: Path) -> str:
    try:
        key_pair = nkeys.from_seed(bytearray(seed_file.read_bytes().strip()))
    except nkeys.NkeysError as error:
        raise NotASeedError(
            f"{seed_file} does not hold an nkey seed (`jetshard up` writes them to <data dir>/creds)"
        ) from error
    try:
        return str(key_pair.public_key.decode())
    finally:
        key_pair.wipe()
