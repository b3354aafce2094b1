"""The form of a model a node's downloader makes available follows the engine of the instance it serves:
llama.cpp's `model.gguf`, or the MLX directory (converted from the GGUF where that is its source). One model
directory holds both forms, each complete or not on its own."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.harness import Cluster
from jetshard_downloader.convert import convert_packaged, place_packaged
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.gguf import packaged_demo_gguf
from jetshard_downloader.local import complete_forms, find_shard
from jetshard_downloader.locate import find_model
from jetshard_downloader.manifest import read_manifest
from jetshard_schema.cards import ModelFormat
from jetshard_schema.catalogue import DEMO_MODEL_ID, builtin_cards
from jetshard_schema.commands import PlaceInstance
from jetshard_schema.ids import model_dir_name, new_instance_id
from jetshard_schema.state import instance_status
from jetshard_schema.types import Engine, InstanceStatus, ServingSettings


def test_the_demo_s_gguf_and_its_mlx_conversion_share_one_directory(tmp_path: Path) -> None:
    card = builtin_cards()[DEMO_MODEL_ID]
    dirs = ModelDirs.from_options(tmp_path / "models")
    directory, size = place_packaged(card, dirs)
    gguf = packaged_demo_gguf()
    assert directory == tmp_path / "models" / model_dir_name(DEMO_MODEL_ID) and size == gguf.stat().st_size
    assert (directory / "model.gguf").read_bytes() == gguf.read_bytes()
    if os.stat(gguf).st_dev == os.stat(directory).st_dev:
        assert os.stat(directory / "model.gguf").st_ino == os.stat(gguf).st_ino  # a hard link: no copy
    found = find_shard(dirs, card, 0, card.num_layers, ModelFormat.GGUF)
    assert found is not None and found[0].path == directory and found[1] == size
    assert find_shard(dirs, card, 0, card.num_layers, ModelFormat.MLX) is None  # no MLX form yet
    assert complete_forms(dirs, card, found[0], 0, card.num_layers) == (ModelFormat.GGUF,)

    converted, _ = convert_packaged(card, dirs)
    assert converted == directory and (directory / "config.json").is_file()
    assert (directory / "model.gguf").stat().st_size == size  # the GGUF stays beside its conversion
    manifest = read_manifest(directory)
    assert manifest is not None and {"model.gguf", "config.json"} <= set(manifest.sizes())
    assert set(complete_forms(dirs, card, found[0], 0, card.num_layers)) == {ModelFormat.GGUF, ModelFormat.MLX}
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [directory.name]  # no staging left

    # The GGUF form counts on its own: gone, only the MLX form is complete, and the model is still found.
    (directory / "model.gguf").unlink()
    assert find_shard(dirs, card, 0, card.num_layers, ModelFormat.GGUF) is None
    assert find_shard(dirs, card, 0, card.num_layers, ModelFormat.MLX) is not None
    assert find_model(dirs, DEMO_MODEL_ID) is not None


async def test_a_llama_cpp_instance_gets_the_gguf_and_no_conversion(cluster: Cluster, tmp_path: Path) -> None:
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config, engines=(Engine.LLAMA_CPP,))
    cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    instance_id = new_instance_id()
    serving = ServingSettings(engine=Engine.LLAMA_CPP)
    await cluster.submit(
        PlaceInstance(instance_id=instance_id, model_id=DEMO_MODEL_ID, node_ids=(node,), serving=serving)
    )
    done = await cluster.wait_download_of(node, DEMO_MODEL_ID, ModelFormat.GGUF, 60)
    directory = models / model_dir_name(DEMO_MODEL_ID)
    assert done.progress.directory == str(directory) and done.progress.formats == (ModelFormat.GGUF,)
    assert done.progress.bytes_done == packaged_demo_gguf().stat().st_size
    assert sorted(p.name for p in directory.iterdir()) == [".jetshard-manifest.json", "model.gguf"]
    assert not done.progress.holds(ModelFormat.MLX)  # an MLX runner of this model would still wait
    state = cluster.follower.state
    assert instance_status(state, state.instances[instance_id]) is InstanceStatus.WAITING  # for its runner, not files
