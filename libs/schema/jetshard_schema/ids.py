"""Identifiers. Plain strings on the wire; `NewType`s in code so a node id is never passed as a model id.

`ModelId` is untrusted input everywhere (HTTP paths, command payloads): `parse_model_id` is the only way to
make one, and its directory form can never escape a models directory.
"""

from __future__ import annotations

import re
import uuid
from typing import NewType

NodeId = NewType("NodeId", str)
CommandId = NewType("CommandId", str)
ModelId = NewType("ModelId", str)
InstanceId = NewType("InstanceId", str)
TaskId = NewType("TaskId", str)

MODEL_ID_MAX_LENGTH = 96
"""The Hub limits a repo name to 96 characters; the whole id is held to the same bound."""

# The Hub allows letters, digits, '-', '_' and '.' in an owner or repo name; '--' and '..' are forbidden,
# and a name can neither start nor end with '-' or '.'.
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")


def parse_model_id(value: str) -> ModelId:
    """Validate a Hub repo id `org/name`; raise ValueError saying what is wrong with it."""
    if not isinstance(value, str) or not value:
        raise ValueError("model id is empty; expected 'org/name'")
    if len(value) > MODEL_ID_MAX_LENGTH:
        raise ValueError(f"model id is longer than {MODEL_ID_MAX_LENGTH} characters")
    parts = value.split("/")
    if len(parts) != 2:
        raise ValueError(f"model id {value!r} must have exactly one '/', as in 'org/name'")
    for part in parts:
        if not part:
            raise ValueError(f"model id {value!r} has an empty part; expected 'org/name'")
        if not _PART.fullmatch(part) or ".." in part or "--" in part:
            raise ValueError(
                f"model id {value!r}: {part!r} may hold only letters, digits, '-', '_' and '.', "
                "must start and end with a letter or digit, and may not contain '--' or '..'"
            )
    return ModelId(value)


def model_dir_name(model_id: ModelId) -> str:
    """The directory form `org--name` of a validated id: one path component, never '..' or absolute."""
    org, name = parse_model_id(model_id).split("/")
    return f"{org}--{name}"


def new_id() -> str:
    return uuid.uuid4().hex


def new_command_id() -> CommandId:
    return CommandId(new_id())


def new_instance_id() -> InstanceId:
    return InstanceId(f"inst-{uuid.uuid4().hex[:12]}")


def new_task_id() -> TaskId:
    return TaskId(f"task-{uuid.uuid4().hex}")
