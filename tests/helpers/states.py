"""Building a State from events, as a follower would: each event at the next stream sequence."""

from __future__ import annotations

from jetshard_schema.events import Event
from jetshard_schema.state import State, apply


def fold(*events: Event, state: State | None = None) -> State:
    state = state or State()
    for event in events:
        state = apply(state, event, state.last_seq + 1, state.last_command_seq + 1)
    return state
