"""JSON encoding of commands, events and State, and tolerant decoding of what another version wrote."""

from __future__ import annotations

import logging
import typing

import msgspec

from jetshard_schema.commands import Command
from jetshard_schema.events import Event, EventEnvelope, RawEventEnvelope
from jetshard_schema.state import State
from jetshard_schema.types import Chunk, TaskRequest

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_command_decoder = msgspec.json.Decoder(Command)  # type: ignore[arg-type]
_raw_envelope_decoder = msgspec.json.Decoder(RawEventEnvelope)
_event_decoder = msgspec.json.Decoder(Event)  # type: ignore[arg-type]
_state_decoder = msgspec.json.Decoder(State)
_warned_types: set[str] = set()
_known_event_types = {member.__name__ for member in typing.get_args(Event)}


def encode(value: object) -> bytes:
    return _encoder.encode(value)


def decode_command(data: bytes) -> Command:
    """Raises msgspec.ValidationError / DecodeError with a readable message for a bad command."""
    return _command_decoder.decode(data)


def decode_event(data: bytes) -> EventEnvelope | None:
    """Decode a stored event; None (with one warning per unknown type) for what this version can't read."""
    try:
        raw = _raw_envelope_decoder.decode(data)
    except msgspec.DecodeError as error:
        log.warning("skipping a malformed event: %s", error)
        return None
    try:
        event = _event_decoder.decode(raw.event)
    except msgspec.ValidationError as error:
        type_name = _event_type_name(raw.event)
        if type_name in _known_event_types:  # a hostile or corrupt event: worth a warning every time
            log.warning("skipping an invalid %s event: %s", type_name, error)
        elif type_name not in _warned_types:
            _warned_types.add(type_name)
            log.warning("skipping event type %r that this version cannot read (%s)", type_name, error)
        return None
    return EventEnvelope(
        command_id=raw.command_id,
        command_seq=raw.command_seq,
        index=raw.index,
        count=raw.count,
        at_ms=raw.at_ms,
        event=event,
    )


def _event_type_name(raw: msgspec.Raw) -> str:
    try:
        return str(msgspec.json.decode(raw).get("type", "?"))
    except (msgspec.DecodeError, AttributeError):
        return "?"


def decode_state(data: bytes) -> State:
    return _state_decoder.decode(data)


_chunk_decoder = msgspec.json.Decoder(Chunk)
_task_request_decoder = msgspec.json.Decoder(TaskRequest)


def decode_chunk(data: bytes) -> Chunk:
    return _chunk_decoder.decode(data)


def decode_task_request(data: bytes) -> TaskRequest:
    return _task_request_decoder.decode(data)
