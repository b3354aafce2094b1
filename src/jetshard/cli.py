"""The `jetshard` command. Every flag `--x-y` also reads the environment variable `JETSHARD_X_Y`."""

from __future__ import annotations

import click

from jetshard.commands.chat import chat
from jetshard.commands.download import download
from jetshard.commands.engines import engines
from jetshard.commands.import_gguf import import_gguf
from jetshard.commands.inspect import events, state
from jetshard.commands.instances import instances, tasks
from jetshard.commands.models import models
from jetshard.commands.services import api, credentials, downloader, sequencer, worker
from jetshard.commands.status import status
from jetshard.lan.commands import lan
from jetshard.options import COMMAND_CONTEXT
from jetshard.up.command import up


@click.group(context_settings=COMMAND_CONTEXT)
@click.version_option(package_name="jetshard")
def main() -> None:
    """jetshard: run large language models across the machines you already own."""


for command in (up, models, download, instances, tasks, status, chat, lan, sequencer, api, worker, downloader):
    main.add_command(command)
for command in (credentials, events, state, engines):
    main.add_command(command)
models.add_command(import_gguf)
