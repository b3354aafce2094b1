"""The only places that turn untrusted names (model ids, repo file names) into filesystem paths.

Model ids arrive in HTTP paths and command payloads, file names in a repo's safetensors index or its Hub
listing; either could be crafted to point outside a models directory. Everything below validates first and
builds paths from the validated form only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
from pathlib import Path, PurePosixPath

from jetshard_schema.ids import ModelId, model_dir_name

MANIFEST_NAME = ".jetshard-manifest.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
GGUF_NAME = "model.gguf"
"""A GGUF model directory's model, the file llama.cpp loads (a split model's: a link to its first part)."""
GGUF_SUFFIX = ".gguf"
MMPROJ_NAME = "mmproj.gguf"
"""A GGUF model directory's projector, for a model that sees."""

# Names jetshard itself keeps inside a model directory; a repo file may not shadow them.
_RESERVED_TOP = {MANIFEST_NAME, ".cache"}
_COMMIT_OR_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def model_path(models_dir: Path, model_id: ModelId | str) -> Path:
    """`<models_dir>/<org>--<name>`; raises ValueError for an id that is not a valid `org/name`."""
    return models_dir / model_dir_name(ModelId(model_id))


def hf_cache_repo_path(models_dir: Path, model_id: ModelId | str) -> Path:
    """`<models_dir>/models--<org>--<name>`, the folder huggingface_hub's cache uses for a model repo."""
    return models_dir / f"models--{model_dir_name(ModelId(model_id))}"


def check_repo_filename(name: str) -> str:
    """Return `name` if it is a safe relative file name inside a repo (`a/b.safetensors`), else ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError("repo file name is empty")
    if "\\" in name or "\x00" in name:
        raise ValueError(f"repo file name {name!r} contains a backslash or NUL")
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("/"):
        raise ValueError(f"repo file name {name!r} is absolute")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"repo file name {name!r} has an empty, '.' or '..' component")
    if parts[0] in _RESERVED_TOP or parts[0].startswith(".jetshard"):
        raise ValueError(f"repo file name {name!r} would shadow jetshard's own bookkeeping")
    return name


def file_in(model_dir: Path, name: str) -> Path:
    """Path of repo file `name` inside `model_dir`, validated."""
    return model_dir.joinpath(*check_repo_filename(name).split("/"))


def check_ref_component(value: str) -> str:
    """A commit hash or ref name read from disk (`refs/main`) used as one path component."""
    value = value.strip()
    if not _COMMIT_OR_REF.fullmatch(value) or ".." in value:
        raise ValueError(f"revision {value!r} is not a safe single path component")
    return value


STAGING = "convert"
TOMBSTONE = "deleting"


def side_directory(target: Path, kind: str) -> Path:
    """A hidden sibling of `target` for work in progress, `.<name>.<kind>-<random>`: a model directory being
    built (STAGING) or removed (TOMBSTONE). A rename between siblings is atomic, so `target` is never seen
    half-made or half-gone; a crash leaves only the side directory, which `sweep_side_directories` removes."""
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(6)}")


def sweep_side_directories(models_dir: Path, kind: str) -> int:
    """Remove the side directories of `kind` that interrupted work left in `models_dir`; returns how many."""
    count = 0
    if not models_dir.is_dir():
        return 0
    for entry in models_dir.iterdir():
        left_over = entry.name.startswith(".") and f".{kind}-" in entry.name
        if left_over and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            count += 1
    return count


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_directories(new: Path, target: Path) -> None:
    """Put the directory `new` at `target` and the directory that was at `target` at `new`, its sibling.

    One renameat2(RENAME_EXCHANGE) where the kernel and filesystem offer it, so `target` is never missing;
    elsewhere two renames, with a moment between them in which it is.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(target), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(new), None, str(target))
    aside = side_directory(target, STAGING)
    target.rename(aside)
    new.rename(target)
    aside.rename(new)
