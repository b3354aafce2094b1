"""How the client commands print what the API answers: a table, or its JSON with `--json`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console, RenderableType


def console() -> Console:
    # Wide enough that ids and node names are not cut when the output is piped or captured.
    return Console(width=None if sys.stdout.isatty() else 200)


def print_answer(answer: Any, as_json: bool, table: Callable[[Any], RenderableType], nothing: str = "") -> None:
    """`answer` as indented JSON, else as `table(answer)`; `nothing` instead of an empty table, when given."""
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    elif nothing and not answer:
        click.echo(nothing)
    else:
        console().print(table(answer))
