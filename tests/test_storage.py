"""The downloader's storage core without a network: directories, shard files, completeness, choice, delete."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from jetshard_downloader.choose import Choice, NoSpace, choose_directory
from jetshard_downloader.delete import ReadOnlyModelError, delete_model, sweep_tombstones
from jetshard_downloader.dirs import ModelDirs, directory_report, room_bytes
from jetshard_downloader.fetch import OfflineUnavailable, fetch_files, is_offline, list_remote_files
from jetshard_downloader.locate import find_model, hf_cache_snapshots, is_complete, partial_bytes_for
from jetshard_downloader.manifest import Manifest, ManifestFile, read_manifest, write_manifest
from jetshard_downloader.paths import MANIFEST_NAME, check_repo_filename, model_path
from jetshard_downloader.shard_files import files_for_layer_range, required_files, support_files

MODEL = "acme/tiny-7b"
BAD_IDS = ["../etc", "acme/..", "acme/../../x", "/abs/path", "acme", "a/b/c", "acme/na--me", "", "acme/.x"]

# ---------------------------------------------------------------------- directories


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(tmp_path / "home"), **extra}


def dirs_from_env(tmp_path: Path, default: str, writable: str, read_only: str) -> ModelDirs:
    """The directories the three `JETSHARD_*` variables name, under a HOME in `tmp_path`."""
    return ModelDirs.from_env(
        env(
            tmp_path,
            JETSHARD_DEFAULT_MODELS_DIR=default,
            JETSHARD_MODELS_DIRS=writable,
            JETSHARD_MODELS_READ_ONLY_DIRS=read_only,
        )
    )


def test_defaults_follow_xdg(tmp_path: Path) -> None:
    dirs = ModelDirs.from_env(env(tmp_path))
    expected = tmp_path / "home" / ".local" / "share" / "jetshard" / "models"
    assert dirs == ModelDirs(default_dir=expected, writable=(expected,), read_only=())

    xdg = ModelDirs.from_env(env(tmp_path, XDG_DATA_HOME=str(tmp_path / "xdg")))
    assert xdg.writable == (tmp_path / "xdg" / "jetshard" / "models",)
    # The XDG spec says a relative XDG_DATA_HOME is invalid and must be ignored.
    relative = ModelDirs.from_env(env(tmp_path, XDG_DATA_HOME="relative/dir"))
    assert relative == dirs


def test_empty_variables_leave_exactly_the_default(tmp_path: Path) -> None:
    dirs = dirs_from_env(tmp_path, "", "", "")
    assert dirs == ModelDirs.from_env(env(tmp_path))


def test_env_lists_order_tilde_empty_entries_and_duplicates(tmp_path: Path) -> None:
    home = tmp_path / "home"
    dirs = dirs_from_env(tmp_path, "~/models", f"::/data/b:~/c:/data/b/::{home}/models:", ":/mnt/shared: /mnt/shared :")
    assert dirs.default_dir == home / "models"
    assert dirs.writable == (home / "models", Path("/data/b"), home / "c")
    assert dirs.read_only == (Path("/mnt/shared"),)
    assert dirs.search_order == (
        (Path("/mnt/shared"), True),
        (home / "models", False),
        (Path("/data/b"), False),
        (home / "c", False),
    )


def test_read_only_wins_over_writable_including_the_default(tmp_path: Path) -> None:
    dirs = dirs_from_env(tmp_path, "/m/default", "/m/a:/m/b", "/m/b:/m/default")
    assert dirs.writable == (Path("/m/a"),)
    assert dirs.read_only == (Path("/m/b"), Path("/m/default"))
    assert dirs.default_dir == Path("/m/default")


def test_from_options_matches_env(tmp_path: Path) -> None:
    by_options = ModelDirs.from_options(
        "~/m", [tmp_path / "w", "", str(tmp_path / "w")], [tmp_path / "ro"], environ=env(tmp_path)
    )
    assert by_options == ModelDirs(
        default_dir=tmp_path / "home" / "m",
        writable=(tmp_path / "home" / "m", tmp_path / "w"),
        read_only=(tmp_path / "ro",),
    )
    with pytest.raises(ValueError, match="both writable and read-only"):
        ModelDirs(default_dir=tmp_path, writable=(tmp_path,), read_only=(tmp_path,))


def test_directory_report_measures_missing_dirs_on_their_filesystem(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    dirs = ModelDirs.from_options(tmp_path / "w", [tmp_path / "not" / "yet"], [tmp_path / "ro"])
    report = directory_report(dirs)
    assert [(r.path, r.read_only, r.is_default, r.exists) for r in report] == [
        (str(tmp_path / "ro"), True, False, False),
        (str(tmp_path / "w"), False, True, True),
        (str(tmp_path / "not" / "yet"), False, False, False),
    ]
    assert all(r.free_bytes > 0 and r.total_bytes >= r.free_bytes for r in report)
    assert 0 < room_bytes(tmp_path / "not" / "yet") < report[2].free_bytes  # measured where it will be made


@dataclass(frozen=True)
class DiskMeasured:
    total: int
    free: int


@pytest.mark.parametrize(
    ("total", "free", "room"),
    [
        (500 << 30, 20 << 30, 19 << 30),  # a large disk keeps 1 GiB free
        (50 << 30, 10 << 30, (10 << 30) - (50 << 30) // 100),  # a smaller one 1% of it
        (50 << 30, 100 << 20, 0),  # a disk already fuller than that has no room for models
    ],
)
def test_models_leave_the_last_percent_of_a_disk_free(tmp_path: Path, total: int, free: int, room: int) -> None:
    assert room_bytes(tmp_path, lambda _: DiskMeasured(total=total, free=free)) == room


# ---------------------------------------------------------------------- shard files


def make_index(num_layers: int, layers_per_file: int, *, tied: bool = False) -> dict:
    """An index laid out like a real sharded checkpoint: embeddings first, norm and head last."""
    num_files = -(-num_layers // layers_per_file)

    def name(i: int) -> str:
        return f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"

    weight_map = {"model.embed_tokens.weight": name(0)}
    for layer in range(num_layers):
        for part in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            weight_map[f"model.layers.{layer}.{part}"] = name(layer // layers_per_file)
    weight_map["model.norm.weight"] = name(num_files - 1)
    if not tied:
        weight_map["lm_head.weight"] = name(num_files - 1)
    return {"metadata": {"total_size": 123}, "weight_map": weight_map}


def test_layer_ranges_pick_only_their_files() -> None:
    index = make_index(12, 3)  # files 1..4 hold layers 0-2, 3-5, 6-8, 9-11
    f = "model-0000{}-of-00004.safetensors".format
    assert files_for_layer_range(index, 12, 0, 3) == {f(1)}
    assert files_for_layer_range(index, 12, 3, 6) == {f(2)}
    assert files_for_layer_range(index, 12, 4, 7) == {f(2), f(3)}
    assert files_for_layer_range(index, 12, 9, 12) == {f(4)}
    assert files_for_layer_range(index, 12, 0, 12) == {f(i) for i in range(1, 5)}


def test_embeddings_go_first_head_last_and_tied_embeddings_last_too() -> None:
    index = make_index(6, 3)
    # Move embeddings and head into files of their own so the rules are visible.
    index["weight_map"]["model.embed_tokens.weight"] = "embed.safetensors"
    index["weight_map"]["lm_head.weight"] = "head.safetensors"
    index["weight_map"]["model.norm.weight"] = "head.safetensors"
    l1, l2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert files_for_layer_range(index, 6, 0, 2) == {"embed.safetensors", l1}
    assert files_for_layer_range(index, 6, 2, 4) == {l1, l2}
    assert files_for_layer_range(index, 6, 4, 6) == {l2, "head.safetensors"}

    del index["weight_map"]["lm_head.weight"]  # tied: the last range projects with the embedding
    assert files_for_layer_range(index, 6, 4, 6) == {l2, "head.safetensors", "embed.safetensors"}
    assert files_for_layer_range(index, 6, 2, 4) == {l1, l2}


def test_layer_parsing_is_generic_and_ignores_other_towers_and_mtp_layers() -> None:
    weight_map = {
        "backbone.embeddings.weight": "a.safetensors",
        "language_model.backbone.layers.0.mixer.weight": "a.safetensors",
        "language_model.backbone.layers.1.mixer.weight": "b.safetensors",
        "language_model.backbone.layers.2.mixer.weight": "c.safetensors",
        "language_model.backbone.layers.3.mixer.weight": "mtp.safetensors",  # beyond num_layers
        "vision_tower.encoder.layers.0.attn.weight": "vision.safetensors",
        "vision_tower.encoder.layers.1.attn.weight": "vision.safetensors",
        "language_model.norm_f.weight": "c.safetensors",
        "lm_head.weight": "c.safetensors",
    }
    index = {"weight_map": weight_map}
    # Other stacks are not the model's layers. A vision tower feeds the embeddings: it goes with the first range.
    assert files_for_layer_range(index, 3, 0, 1) == {"a.safetensors", "vision.safetensors"}
    assert files_for_layer_range(index, 3, 1, 2) == {"b.safetensors"}
    assert files_for_layer_range(index, 3, 2, 3) == {"c.safetensors"}


def test_a_vision_models_tower_and_projector_go_with_the_first_range_and_its_processor_with_every_range() -> None:
    weight_map = {
        "language_model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "language_model.layers.0.mlp.up_proj.weight": "model-00001-of-00003.safetensors",
        "language_model.layers.1.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "language_model.norm.weight": "model-00002-of-00003.safetensors",
        "language_model.lm_head.weight": "model-00002-of-00003.safetensors",
        "vision_model.encoder.layers.0.mlp.fc1.weight": "model-00003-of-00003.safetensors",
        "vision_model.encoder.layers.1.mlp.fc1.weight": "model-00003-of-00003.safetensors",
        "connector.modality_projection.proj.weight": "model-00003-of-00003.safetensors",
    }
    index = {"weight_map": weight_map}
    repo = [*set(weight_map.values()), "config.json", "processor_config.json", "preprocessor_config.json", "README.md"]
    first = required_files(repo, index, 2, 0, 1)
    assert first == {
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "config.json",
        "processor_config.json",
        "preprocessor_config.json",
    }
    assert required_files(repo, index, 2, 1, 2) == {
        "model-00002-of-00003.safetensors",
        "config.json",
        "processor_config.json",
        "preprocessor_config.json",
    }


@pytest.mark.parametrize(
    ("index", "args", "match"),
    [
        (make_index(4, 2), (4, 2, 2), "non-empty range"),
        (make_index(4, 2), (4, -1, 2), "non-empty range"),
        (make_index(4, 2), (4, 0, 5), "non-empty range"),
        (make_index(4, 2), (0, 0, 1), "num_layers must be positive"),
        ({"weight_map": {}}, (4, 0, 1), "no 'weight_map'"),
        ({}, (4, 0, 1), "no 'weight_map'"),
        ({"weight_map": {"model.layers.0.w": "../../etc/passwd.safetensors"}}, (1, 0, 1), r"'\.\.'"),
        ({"weight_map": {"model.layers.0.w": "/abs.safetensors"}}, (1, 0, 1), "absolute"),
        ({"weight_map": {"model.layers.0.w": "x.bin"}}, (1, 0, 1), "not a .safetensors"),
        ({"weight_map": {"model.layers.0.w": 3}}, (1, 0, 1), "pair of strings"),
    ],
)
def test_files_for_layer_range_rejects_bad_input(index: dict, args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        files_for_layer_range(index, *args)


def test_support_files_allow_list() -> None:
    repo = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "pytorch_model.bin",
        "consolidated.pt",
        "model.Q4_K_M.gguf",
        "onnx/model.onnx",
        "onnx/tokenizer.json",
        "original/tokenizer.model",
        "README.md",
        ".gitattributes",
        "flax_model.msgpack",
    ]
    assert support_files(repo) == set(repo[:11])


def test_required_files_for_sharded_and_single_file_models() -> None:
    index = make_index(4, 2)
    repo = ["config.json", "tokenizer.json", "model.safetensors.index.json", "README.md"]
    repo += sorted(set(index["weight_map"].values()))
    assert required_files(repo, index, 4, 0, 2) == {
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    }
    assert required_files(["config.json", "model.safetensors"], None, 4, 2, 4) == {
        "config.json",
        "model.safetensors",
    }
    with pytest.raises(ValueError, match="does not have"):
        required_files(repo[:4], index, 4, 0, 2)
    with pytest.raises(ValueError, match="neither"):
        required_files(["config.json"], None, 4, 0, 2)


# ---------------------------------------------------------------------- ids and file names


@pytest.mark.parametrize("bad", BAD_IDS)
def test_untrusted_ids_never_become_paths(tmp_path: Path, bad: str) -> None:
    dirs = ModelDirs.from_options(tmp_path / "w", [], [tmp_path / "ro"])
    (tmp_path / "victim").mkdir()
    with pytest.raises(ValueError):
        model_path(tmp_path / "w", bad)
    with pytest.raises(ValueError):
        find_model(dirs, bad)
    with pytest.raises(ValueError):
        delete_model(dirs, bad)
    with pytest.raises(ValueError):
        choose_directory(dirs, bad, 1, lambda d: 10, {}, lambda d: 0)
    assert (tmp_path / "victim").is_dir()


@pytest.mark.parametrize(
    "bad", ["", "../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\b", MANIFEST_NAME, ".cache/x"]
)
def test_unsafe_repo_file_names_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        check_repo_filename(bad)
    dirs = ModelDirs.from_options(tmp_path / "w")
    with pytest.raises(ValueError):
        find_model(dirs, MODEL, {bad})
    assert check_repo_filename("sub/dir/model.safetensors") == "sub/dir/model.safetensors"


# ---------------------------------------------------------------------- completeness


def write_model(model_dir: Path, files: dict[str, bytes], *, manifest: bool, revision: str = "c0ffee") -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = model_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if manifest:
        entries = tuple(ManifestFile(n, len(d), "0" * 64) for n, d in sorted(files.items()))
        write_manifest(model_dir, Manifest(model_id=MODEL, revision=revision, files=entries))


def sharded_files(num_layers: int = 4, layers_per_file: int = 2, *, tied: bool = False) -> dict[str, bytes]:
    index = make_index(num_layers, layers_per_file, tied=tied)
    files = {name: name.encode() * 10 for name in sorted(set(index["weight_map"].values()))}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["config.json"] = b'{"num_hidden_layers": %d}' % num_layers
    files["tokenizer.json"] = b"{}"
    return files


def test_writable_dir_needs_a_manifest(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "w")
    target = model_path(tmp_path / "w", MODEL)
    write_model(target, sharded_files(), manifest=False)
    assert find_model(dirs, MODEL) is None  # every file there, no manifest: an interrupted download
    write_manifest(target, Manifest(model_id=MODEL, revision="c0ffee", files=()))
    assert find_model(dirs, MODEL) is None  # a manifest that lists nothing vouches for nothing
    write_model(target, sharded_files(), manifest=True)
    found = find_model(dirs, MODEL)
    assert found is not None
    assert (found.path, found.read_only, found.models_dir, found.layout) == (
        target,
        False,
        tmp_path / "w",
        "jetshard",
    )


def test_manifest_sizes_are_checked_and_half_written_dirs_are_partial(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "w")
    target = model_path(tmp_path / "w", MODEL)
    files = sharded_files()
    write_model(target, files, manifest=True)
    assert find_model(dirs, MODEL) is not None

    truncated = target / "model-00002-of-00002.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert find_model(dirs, MODEL) is None
    # Shard-aware: the first half of the layers does not need the truncated file.
    first_half = required_files(list(files), make_index(4, 2), 4, 0, 2)
    assert find_model(dirs, MODEL, first_half) is not None
    assert find_model(dirs, MODEL, required_files(list(files), make_index(4, 2), 4, 2, 4)) is None

    truncated.unlink()
    assert find_model(dirs, MODEL) is None
    (target / MANIFEST_NAME).write_text("{not json")
    assert read_manifest(target) is None
    assert find_model(dirs, MODEL, first_half) is None


def test_manifest_lists_the_files_that_are_there(tmp_path: Path) -> None:
    """A shard download leaves a manifest naming only its files: enough for that shard, not the model."""
    dirs = ModelDirs.from_options(tmp_path / "w")
    target = model_path(tmp_path / "w", MODEL)
    files = sharded_files()
    index = make_index(4, 2)
    shard = required_files(list(files), index, 4, 0, 2)
    write_model(target, {n: files[n] for n in shard}, manifest=True)
    assert find_model(dirs, MODEL, shard) is not None
    assert find_model(dirs, MODEL, required_files(list(files), index, 4, 2, 4)) is None
    assert find_model(dirs, MODEL) is None
    # A file on disk that the manifest does not list (a download in flight) does not count.
    (target / "model-00002-of-00002.safetensors").write_bytes(files["model-00002-of-00002.safetensors"])
    assert find_model(dirs, MODEL) is None


def test_read_only_dirs_count_presence_and_are_searched_first(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "w", [], [tmp_path / "ro"])
    write_model(model_path(tmp_path / "w", MODEL), sharded_files(), manifest=True)
    ro_model = model_path(tmp_path / "ro", MODEL)
    files = sharded_files()
    write_model(ro_model, {k: v for k, v in files.items() if k != "config.json"}, manifest=False)
    found = find_model(dirs, MODEL)
    assert found is not None and not found.read_only  # the read-only copy lacks config.json
    (ro_model / "config.json").write_bytes(files["config.json"])
    found = find_model(dirs, MODEL)
    assert found is not None and found.read_only and found.path == ro_model


def test_single_file_model(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "w", [], [tmp_path / "ro"])
    ro_model = model_path(tmp_path / "ro", MODEL)
    write_model(ro_model, {"model.safetensors": b"x" * 100}, manifest=False)
    assert find_model(dirs, MODEL) is None
    (ro_model / "config.json").write_text("{}")
    assert find_model(dirs, MODEL) is not None


def make_hf_cache(root: Path, model_id: str, files: dict[str, bytes], rev: str) -> Path:
    """The layout huggingface_hub's cache leaves: blobs, refs/main, snapshots/<rev>/ of symlinks."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / f"{rev}-{abs(hash(name))}"
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_hf_cache_layout_in_a_read_only_dir(tmp_path: Path) -> None:
    ro = tmp_path / "hf" / "hub"
    dirs = ModelDirs.from_options(tmp_path / "w", [], [ro])
    files = sharded_files()
    old = make_hf_cache(ro, MODEL, files, "a" * 40)
    new = make_hf_cache(ro, MODEL, files, "b" * 40)
    repo = ro / f"models--{MODEL.replace('/', '--')}"
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    found = find_model(dirs, MODEL)
    assert found is not None
    assert (found.path, found.read_only, found.layout) == (old, True, "hf-cache")

    # refs/main points at a snapshot with a dangling link (its blob went away): the other one is used.
    os.unlink(os.path.realpath(old / "model-00001-of-00002.safetensors"))
    found = find_model(dirs, MODEL)
    assert found is not None and found.path == new

    # A refs/main that tries to climb out is ignored, not followed.
    (repo / "refs" / "main").write_text("../../../../etc")
    assert set(hf_cache_snapshots(repo)) == {old, new}
    assert find_model(dirs, MODEL) is not None

    # The HF cache layout is for read-only directories only: jetshard never writes one.
    dirs_w = ModelDirs.from_options(ro)
    assert find_model(dirs_w, MODEL) is None


def test_is_complete_on_missing_dir(tmp_path: Path) -> None:
    assert not is_complete(tmp_path / "nope", None, read_only=True)


# ---------------------------------------------------------------------- choosing a directory


def three_dirs(tmp_path: Path) -> tuple[ModelDirs, Path, Path, Path]:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    return ModelDirs.from_options(a, [b, c], [tmp_path / "ro"]), a, b, c


def test_choose_first_directory_with_room(tmp_path: Path) -> None:
    dirs, a, b, c = three_dirs(tmp_path)
    free = {a: 50, b: 200, c: 1000}
    choice = choose_directory(dirs, MODEL, 100, free.__getitem__, {}, lambda d: 0)
    assert choice == Choice(models_dir=b, model_dir=b / "acme--tiny-7b", bytes_remaining=100, resumes=False)
    # The default wins when it has room, even with less room than the others.
    free[a] = 100
    choice = choose_directory(dirs, MODEL, 100, free.__getitem__, {}, lambda d: 0)
    assert isinstance(choice, Choice) and choice.models_dir == a


def test_choose_counts_reservations_of_running_downloads(tmp_path: Path) -> None:
    dirs, a, b, c = three_dirs(tmp_path)
    free = {a: 150, b: 150, c: 1000}
    choice = choose_directory(dirs, MODEL, 100, free.__getitem__, {a: 60, b: 50}, lambda d: 0)
    assert isinstance(choice, Choice) and choice.models_dir == b


def test_choose_prefers_a_partial_download_with_room_for_the_rest(tmp_path: Path) -> None:
    dirs, a, b, c = three_dirs(tmp_path)
    free = {a: 1000, b: 30, c: 1000}
    partial = {a: 0, b: 80, c: 10}
    choice = choose_directory(dirs, MODEL, 100, free.__getitem__, {}, partial.__getitem__)
    assert choice == Choice(models_dir=b, model_dir=b / "acme--tiny-7b", bytes_remaining=20, resumes=True)
    # Without room for the rest, the partial directory loses its priority (and c's partial then wins).
    free[b] = 10
    choice = choose_directory(dirs, MODEL, 100, free.__getitem__, {}, partial.__getitem__)
    assert isinstance(choice, Choice) and choice.models_dir == c and choice.bytes_remaining == 90


def test_choose_reports_no_space_with_every_directory(tmp_path: Path) -> None:
    dirs, a, b, c = three_dirs(tmp_path)
    free = {a: 1 << 30, b: 5 << 30, c: 0}
    result = choose_directory(dirs, MODEL, 8 << 30, free.__getitem__, {b: 1 << 30}, lambda d: 0)
    assert isinstance(result, NoSpace)
    assert result.bytes_needed == 8 << 30
    assert [c_.models_dir for c_ in result.checked] == [a, b, c]
    assert "8.0 GiB needed" in result.message
    assert f"{a}: 1.0 GiB free for models\n" in result.message
    assert result.message.endswith("(models leave 1% of a disk, at most 1.0 GiB, free)")
    assert f"{b}: 5.0 GiB free for models, 1.0 GiB reserved" in result.message
    assert str(tmp_path / "ro") not in result.message  # read-only directories are not candidates


def test_choose_with_no_writable_directory(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "d", [], [tmp_path / "d"])
    result = choose_directory(dirs, MODEL, 1, lambda d: 10, {}, lambda d: 0)
    assert isinstance(result, NoSpace) and "no writable model directory" in result.message
    with pytest.raises(ValueError, match="bytes_needed"):
        choose_directory(dirs, MODEL, -1, lambda d: 10, {}, lambda d: 0)


def test_partial_bytes_reads_the_model_dir(tmp_path: Path) -> None:
    write_model(model_path(tmp_path, MODEL), {"a.safetensors": b"x" * 7, "sub/b": b"y" * 5}, manifest=False)
    assert partial_bytes_for(MODEL)(tmp_path) == 12
    assert partial_bytes_for(MODEL)(tmp_path / "elsewhere") == 0


# ---------------------------------------------------------------------- delete and offline


def test_delete_removes_writable_copies_only(tmp_path: Path) -> None:
    dirs = ModelDirs.from_options(tmp_path / "a", [tmp_path / "b"], [tmp_path / "ro"])
    for d in ("a", "b", "ro"):
        write_model(model_path(tmp_path / d, MODEL), sharded_files(), manifest=True)
    other = model_path(tmp_path / "a", "acme/other")
    write_model(other, sharded_files(), manifest=True)

    result = delete_model(dirs, MODEL)
    assert result.removed == (model_path(tmp_path / "a", MODEL), model_path(tmp_path / "b", MODEL))
    assert result.kept_read_only == (model_path(tmp_path / "ro", MODEL),)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["acme--other"]
    assert find_model(dirs, MODEL) is not None  # still usable from the read-only copy

    with pytest.raises(ReadOnlyModelError, match="only in read-only"):
        delete_model(dirs, MODEL)
    assert model_path(tmp_path / "ro", MODEL).is_dir()
    assert delete_model(dirs, "acme/nowhere").removed == ()


def test_delete_drops_a_symlink_not_its_target(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write_model(elsewhere, sharded_files(), manifest=True)
    (tmp_path / "w").mkdir()
    model_path(tmp_path / "w", MODEL).symlink_to(elsewhere)
    delete_model(ModelDirs.from_options(tmp_path / "w"), MODEL)
    assert not model_path(tmp_path / "w", MODEL).exists()
    assert (elsewhere / "config.json").is_file()


def test_sweep_tombstones(tmp_path: Path) -> None:
    (tmp_path / ".acme--x.deleting-123" / "sub").mkdir(parents=True)
    (tmp_path / "acme--keep").mkdir()
    assert sweep_tombstones(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["acme--keep"]


@pytest.mark.parametrize("var", ["JETSHARD_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_fails_at_once_without_a_request(tmp_path: Path, var: str) -> None:
    environ = {var: "1"}
    assert is_offline(environ) and not is_offline({var: "0"})
    # An endpoint nothing listens on: any request would fail differently (and slowly).
    with pytest.raises(OfflineUnavailable, match="not available offline"):
        list_remote_files(MODEL, environ=environ, endpoint="http://127.0.0.1:9")
    with pytest.raises(OfflineUnavailable, match="not available offline"):
        fetch_files(MODEL, "main", tmp_path / "m", [], environ=environ, endpoint="http://127.0.0.1:9")
    assert not (tmp_path / "m").exists()
