"""Identifiers. Plain strings on the wire; `NewType`s in code so a node id is never passed as a model id.

Every id is untrusted input (HTTP paths, command payloads, events anyone with stream access could append):
the `Valid…` aliases carry msgspec constraints and are what wire Structs declare, so a message holding a bad
id fails to decode instead of reaching a path, a NATS subject or a KV key. `parse_model_id` validates a model
id from code with a message saying what is wrong; its directory form can never escape a models directory.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, NewType

import msgspec

NodeId = NewType("NodeId", str)
CommandId = NewType("CommandId", str)
ModelId = NewType("ModelId", str)
InstanceId = NewType("InstanceId", str)
TaskId = NewType("TaskId", str)

MODEL_ID_MAX_LENGTH = 96
"""The Hub limits a repo name to 96 characters; the whole id is held to the same bound."""

# The Hub allows letters, digits, '-', '_' and '.' in an owner or repo name; '--' and '..' are forbidden,
# and a name can neither start nor end with '-' or '.'.
_PART_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_PART = re.compile(_PART_PATTERN)
MODEL_ID_PATTERN = rf"^(?!.*(?:\.\.|--)){_PART_PATTERN}/{_PART_PATTERN}$"

NAME_MAX_LENGTH = 64
"""Node, instance, task and session ids: one path component, one NATS subject token, one KV key."""
COMMAND_ID_MAX_LENGTH = 160
"""Room for the sequencer's `expire-<node id>-<session id>-<event sequence>`."""
# No '.', '*', '>' or '/': such ids become file names, subject tokens and KV keys. A leading letter, digit or
# '_' also keeps them from reading as an option or a hidden file.
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_-]*$"

ValidModelId = Annotated[ModelId, msgspec.Meta(pattern=MODEL_ID_PATTERN, max_length=MODEL_ID_MAX_LENGTH)]
ValidNodeId = Annotated[NodeId, msgspec.Meta(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
ValidInstanceId = Annotated[InstanceId, msgspec.Meta(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
ValidTaskId = Annotated[TaskId, msgspec.Meta(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
ValidImportId = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
ValidSessionId = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)]
ValidCommandId = Annotated[CommandId, msgspec.Meta(pattern=NAME_PATTERN, max_length=COMMAND_ID_MAX_LENGTH)]


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


def parse_name(value: str, what: str) -> str:
    """Validate a node, instance or task id (`NAME_PATTERN`); raise ValueError naming `what` it was to be."""
    if len(value) > NAME_MAX_LENGTH or not re.fullmatch(NAME_PATTERN, value):
        raise ValueError(
            f"{value[:80]!r} is not a valid {what}: use letters, digits, '_' and '-' (at most {NAME_MAX_LENGTH}), "
            "not starting with '-'"
        )
    return value


IMPORTED_NAME_LENGTH = 80
"""The longest name an imported file's id takes from the file's name."""


def import_model_id(model_id: str | None, path: str) -> ModelId:
    """The id an imported file is served as: `model_id` when given, else `local/<file name without extension>`, with
    what a Hub name may not hold replaced, a split model's part number left out, and a name too long cut in its
    middle: its end names the quantization, which tells two files of one model apart. ValueError says what is
    wrong with either."""
    if model_id:
        return parse_model_id(model_id)
    file_name = path.rsplit("/", 1)[-1]
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", file_name.rsplit(".", 1)[0])
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem)
    name = re.sub(r"-{2,}|\.{2,}", "-", name).strip("-._")
    name = _shortened(name, IMPORTED_NAME_LENGTH)
    if not name:
        raise ValueError(f"the file name {file_name!r} leaves nothing to name the model by: give it an id")
    return parse_model_id("local/" + name)


def _shortened(name: str, most: int) -> str:
    """`name` in at most `most` characters: whole '-'-separated words from its end (up to half), then from its start;
    cut mid-word only where its words are too few."""
    if len(name) <= most:
        return name
    words = name.split("-")
    tail: list[str] = []
    while len(words) > 1 and len("-".join([words[-1], *tail])) <= most // 2:
        tail.insert(0, words.pop())
    head: list[str] = []
    for word in words:
        if len("-".join([*head, word, *tail])) > most:
            break
        head.append(word)
    if not head or not tail:
        return name[: most // 2].rstrip("-._") + "-" + name[most // 2 + 1 - most :].lstrip("-._")
    return "-".join(head + tail)


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
