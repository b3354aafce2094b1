"""The services' flags, generated from their config structs' fields (`jetshard.options.FieldFlags`): the flag, its
environment variable, default, range and help come from the field, and the struct is built from what was given."""

from __future__ import annotations

from typing import Any

import click
from click.testing import CliRunner
from jetshard_api.settings import InferenceSettings

from jetshard.commands.services import api, api_serving_options, downloader, worker


def options_of(command: click.Command) -> dict[str, click.Option]:
    return {param.opts[0]: param for param in command.params if isinstance(param, click.Option)}


def test_a_bool_field_is_a_flag_pair_unless_its_meta_makes_it_a_switch() -> None:
    api_options, downloader_options = options_of(api), options_of(downloader)
    assert api_options["--auto-place"].secondary_opts == ["--no-auto-place"]
    assert api_options["--fetch-image-urls"].secondary_opts == ["--no-fetch-image-urls"]
    assert downloader_options["--peer-copies"].secondary_opts == ["--no-peer-copies"]
    assert downloader_options["--offline"].is_flag and not downloader_options["--offline"].secondary_opts


def test_a_field_gives_its_flag_default_range_choices_and_help() -> None:
    worker_options = options_of(worker)
    assert worker_options["--runner-start-timeout-s"].default == 300.0
    assert worker_options["--runner-start-timeout-s"].envvar == "JETSHARD_RUNNER_START_TIMEOUT_S"
    assert isinstance(variants := worker_options["--llama-cpp-cpu-variants"].type, click.Choice)
    assert (list(variants.choices), worker_options["--llama-cpp-cpu-variants"].default) == (["all", "avx2"], "all")
    assert worker_options["--memory-limit-gib"].default is None
    assert "what the machine has available" in (worker_options["--memory-limit-gib"].help or "")
    assert isinstance(batch := options_of(api)["--max-batch"].type, click.IntRange)
    assert (batch.min, batch.max) == (1, 256)


def test_the_struct_is_built_from_flags_and_environment_and_a_refused_value_names_its_flag() -> None:
    built: list[InferenceSettings] = []

    @click.command()
    @api_serving_options
    def serve(inference: InferenceSettings, **_: Any) -> None:
        built.append(inference)

    runner = CliRunner()
    given = ["--no-auto-place", "--image-dir", "/tmp", "--max-batch", "3", "--command-timeout-s", "7"]
    result = runner.invoke(serve, given, env={"JETSHARD_FETCH_IMAGE_URLS": "1", "JETSHARD_STREAM_PING_S": "2"})
    assert result.exit_code == 0, result.output
    (settings,) = built
    assert (settings.auto_place, settings.command_timeout_s, settings.stream_ping_s) == (False, 7.0, 2.0)
    assert (settings.images.fetch_urls, settings.images.local_dirs, settings.serving.max_batch) == (True, ("/tmp",), 3)
    assert settings.chunk_silence_s == InferenceSettings().chunk_silence_s

    out_of_range = runner.invoke(serve, ["--stream-ping-s", "0"])
    assert out_of_range.exit_code == 2 and "--stream-ping-s" in out_of_range.output
    not_a_number = runner.invoke(serve, ["--stream-ping-s", "nan"])  # passes click's range, not the field's bound
    assert not_a_number.exit_code == 2 and "--stream-ping-s" in not_a_number.output
