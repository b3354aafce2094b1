"""Any GGUF llama.cpp loads becomes a card: read from its header (never its tensors), refused with the problem
named when it is not one, imported by the node's own downloader.

The files are written here with llama.cpp's own gguf-py (`GGUFWriter`): tiny tensors, real metadata.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import httpx
import msgspec
import numpy as np
import pytest
from helpers.cards import tiny_card
from helpers.harness import Cluster
from helpers.states import fold
from jetshard_downloader.dirs import ModelDirs
from jetshard_downloader.gguf_header import read_gguf_header
from jetshard_downloader.import_file import ImportRefused, read_import, store_import
from jetshard_downloader.locate import find_model
from jetshard_schema.cards import ModelCapability, ModelFormat, ModelSource, Quantization
from jetshard_schema.commands import ImportModelFile, ReportModelImport
from jetshard_schema.events import (
    CustomModelCardAdded,
    DownloadCompleted,
    InstancePlaced,
    ModelImportProgressed,
    ModelImportRequested,
    NodeJoined,
)
from jetshard_schema.gguf_card import UnsupportedGguf, card_from_gguf
from jetshard_schema.gguf_header import NeedMoreBytes, parse_gguf_header
from jetshard_schema.ids import CommandId, ModelId, NodeId, import_model_id
from jetshard_schema.types import DownloadStatus, ImportProgress, ImportStatus, NodeProfile, ShardAssignment
from jetshard_sequencer.handlers import Context, handle

QWEN3_TEMPLATE = (
    "{% if tools %}<tools>{{ tools }}</tools>{% endif %}{% for m in messages %}<think>\n</think>{% endfor %}"
)


def write_gguf(
    path: Path,
    arch: str,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | Sequence[int] = 2,
    context: int | float | None = 2048,
    name: str | None = None,
    file_type: gguf.LlamaFileType = gguf.LlamaFileType.MOSTLY_Q4_K_M,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_K,
    template: str = "",
    pre: str = "default",
    extra: dict[str, Any] | None = None,
    tokens: int = 300,
    embedding_rows: int | None = None,
) -> Path:
    """A GGUF file of `arch` with the metadata llama.cpp reads, one embedding (a row per token unless
    `embedding_rows` says) and one weight of `tensor_type`. `context`: a float is written as one (a wrong type),
    None leaves it out."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem if name is None else name)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    if isinstance(kv_heads, int):
        writer.add_head_count_kv(kv_heads)
    else:
        writer.add_array(f"{arch}.attention.head_count_kv", list(kv_heads))
    if isinstance(context, float):
        writer.add_float32(f"{arch}.context_length", context)
    elif context is not None:
        writer.add_context_length(context)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    if template:
        writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    rows = tokens if embedding_rows is None else embedding_rows
    writer.add_tensor("token_embd.weight", np.zeros((rows, hidden), dtype=np.float32))
    block = gguf.GGML_QUANT_SIZES[tensor_type]
    if tensor_type in (gguf.GGMLQuantizationType.F32,):
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((hidden, hidden), dtype=np.float32))
    else:
        rows = np.zeros((hidden, hidden // block[0] * block[1] if hidden >= block[0] else block[1]), dtype=np.uint8)
        writer.add_tensor("blk.0.attn_q.weight", rows, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def card_of(path: Path, model_id: str = "local/m", **kwargs: Any) -> Any:
    return card_from_gguf(
        model_id,
        read_gguf_header(path),
        file_sizes_bytes=[path.stat().st_size],
        source=ModelSource.LOCAL_GGUF,
        source_ref=str(path),
        **kwargs,
    )


def test_a_k_quant_qwen3_is_a_llama_cpp_only_card_with_its_tools_and_thinking(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "Qwen3-Q4_K_M.gguf", "qwen3", context=40960, template=QWEN3_TEMPLATE)
    card = card_of(path)
    assert (card.architecture, card.num_layers, card.hidden_size) == ("qwen3", 2, 64)
    assert (card.num_attention_heads, card.num_key_value_heads, card.vocab_size) == (4, 2, 300)
    assert card.context_length == 40960 and card.storage_size_bytes == path.stat().st_size
    assert card.file_type == "Q4_K_M" and card.quantization is None
    assert card.parameter_count == sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(path).tensors)
    assert card.formats == (ModelFormat.GGUF,)  # MLX's converter takes llama alone: llama.cpp only
    assert ModelCapability.TOOLS in card.capabilities and ModelCapability.THINKING in card.capabilities
    assert ModelCapability.VISION not in card.capabilities


def test_gemma3_per_layer_kv_heads_take_the_largest_and_a_projector_makes_it_see(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "gemma.gguf",
        "gemma3",
        heads=8,
        kv_heads=[4, 2],
        file_type=gguf.LlamaFileType.MOSTLY_IQ4_XS,
        tensor_type=gguf.GGMLQuantizationType.IQ4_XS,
        template="{{ messages }}",
    )
    card = card_of(path, has_mmproj=True)
    assert card.num_key_value_heads == 4 and card.file_type == "IQ4_XS"
    assert ModelCapability.VISION in card.capabilities and ModelCapability.TOOLS not in card.capabilities
    assert ModelCapability.THINKING not in card.capabilities


def test_a_q8_llama_with_a_known_tokenizer_split_is_also_an_mlx_card(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "llama.gguf",
        "llama",
        file_type=gguf.LlamaFileType.MOSTLY_Q8_0,
        tensor_type=gguf.GGMLQuantizationType.Q8_0,
        pre="smollm",
    )
    card = card_of(path)
    assert card.formats == (ModelFormat.GGUF, ModelFormat.MLX)
    assert card.file_type == "Q8_0" and card.quantization == Quantization(bits=8, group_size=32)
    # The same llama as a K-quant: MLX's converter cannot read it.
    k_quant = write_gguf(tmp_path / "llama-k.gguf", "llama", pre="smollm")
    assert card_of(k_quant).formats == (ModelFormat.GGUF,)


def test_bad_files_are_refused_with_the_problem_named(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf", "qwen3")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"runs past the end of the file .*: the file is truncated"):
        read_gguf_header(truncated)
    not_gguf = tmp_path / "weights.safetensors"
    not_gguf.write_bytes(b"{" + b" " * 100)
    with pytest.raises(ValueError, match="does not start with the GGUF magic bytes"):
        read_gguf_header(not_gguf)
    unknown = write_gguf(tmp_path / "unknown.gguf", "transmogrifier")
    with pytest.raises(UnsupportedGguf, match=r"architecture 'transmogrifier' is not one llama\.cpp knows"):
        card_of(unknown)
    # llama.cpp reads the training context as a positive 32-bit whole number, or does not load the model.
    with pytest.raises(UnsupportedGguf, match=r"lacks qwen3\.context_length, which llama\.cpp needs"):
        card_of(write_gguf(tmp_path / "no-context.gguf", "qwen3", context=None))
    with pytest.raises(UnsupportedGguf, match=r"its qwen3\.context_length is 0, where llama\.cpp needs a positive"):
        card_of(write_gguf(tmp_path / "zero-context.gguf", "qwen3", context=0))
    with pytest.raises(UnsupportedGguf, match=r"its qwen3\.context_length is 4096\.0, where llama\.cpp needs"):
        card_of(write_gguf(tmp_path / "float-context.gguf", "qwen3", context=4096.0))


def test_a_name_from_a_file_reaches_no_terminal_with_its_control_characters(tmp_path: Path) -> None:
    named = write_gguf(tmp_path / "named.gguf", "qwen3", name="\x1b[31mRed\x1b[0m \x1b]52;c;aGk=\x07Model")
    assert card_of(named).display_name == "[31mRed[0m ]52;c;aGk=Model"


def _hostile_header(path: Path, file_size: int, metadata_count: int, entries: Sequence[tuple[bytes, int]]) -> Path:
    """A GGUF file of `file_size` bytes, sparse (it takes no disk), whose header claims `metadata_count` key-value
    pairs: the first ones `(key, length)`, each a string value of `length` bytes; zeros after them."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, metadata_count))
        for key, length in entries:
            f.write(struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, length))
            f.seek(length, os.SEEK_CUR)
        f.truncate(file_size)
    return path


@pytest.mark.timeout(60)
def test_a_header_that_no_model_has_is_refused_without_walking_it(tmp_path: Path) -> None:
    """What a file on the node can claim within its size, where the size is that of a sparse file (or a link to a
    disk): its walk is bounded as the Hub's Range reads are, and llama.cpp's own refusals come before it loads."""
    # A key repeated (here the empty key, in every entry of zeros): llama.cpp refuses a file with a duplicate key.
    # Fewer entries than any count a model could not have (those are refused before the walk: the test below).
    zeros = _hostile_header(tmp_path / "zeros.gguf", 1 << 36, 1 << 12, ())
    with pytest.raises(ValueError, match="metadata key 1 repeats the key ''"):
        read_gguf_header(zeros)
    # Strings of a gigabyte each, which the walk would copy and decode one after another.
    strings = [(b"key.%d" % n, 1 << 30) for n in range(16)]
    long = _hostile_header(tmp_path / "long.gguf", 1 << 40, len(strings), strings)
    with pytest.raises(ValueError, match="its GGUF header is longer than 64 MiB"):
        read_gguf_header(long)
    # Not a regular file: a FIFO would block the reader until someone writes to it; a device has no GGUF header.
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for special, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device"), (tmp_path, "a directory")):
        with pytest.raises(ValueError, match=f"it is {kind}, not a regular file"):
            read_gguf_header(special)
        with pytest.raises(ImportRefused, match=f"{special} is not a readable GGUF file: it is {kind}, not a regular"):
            read_import(ModelId("local/m"), special, None)


def test_a_header_read_from_a_prefix_asks_for_more_until_it_has_it_all(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "qwen3", template=QWEN3_TEMPLATE)
    data = path.read_bytes()
    with pytest.raises(NeedMoreBytes) as more:
        parse_gguf_header(data[:64], len(data))
    size = more.value.size
    while True:
        try:
            header = parse_gguf_header(data[:size], len(data))
            break
        except NeedMoreBytes as error:
            assert error.size > size
            size = max(error.size, size * 2)
    assert header.text("general.architecture") == "qwen3" and header.data_start <= size


def _split(tmp_path: Path, count: int) -> list[Path]:
    parts = []
    for i in range(1, count + 1):
        part = tmp_path / f"big-{i:05d}-of-{count:05d}.gguf"
        write_gguf(part, "qwen3", extra={"split.no": i - 1, "split.count": count})
        parts.append(part)
    return parts


def test_a_split_model_with_a_part_missing_is_refused_and_a_whole_one_stores_all_parts(tmp_path: Path) -> None:
    parts = _split(tmp_path, 3)
    parts[1].unlink()
    with pytest.raises(ImportRefused, match=r"part 1 of a model split into 3 files; missing beside it: big-00002-of"):
        read_import(ModelId("local/big"), parts[0], None)
    write_gguf(parts[1], "qwen3", extra={"split.no": 1, "split.count": 3})
    with pytest.raises(ImportRefused, match=r"name its first part"):
        read_import(ModelId("local/big"), parts[1], None)
    # A file of another model under a part's name: llama-server would fail to load the whole (no split.no).
    write_gguf(parts[2], "qwen3")
    with pytest.raises(ImportRefused, match=r"big-00003-of-00003.gguf is not part 3 of the 3 of big-00001-of-00003"):
        read_import(ModelId("local/big"), parts[0], None)
    write_gguf(parts[2], "qwen3", extra={"split.no": 2, "split.count": 3})
    card, files = read_import(ModelId("local/big"), parts[0], None)
    assert card.storage_size_bytes == sum(p.stat().st_size for p in parts)
    # Each part lists its own tensors: Ollama's parameter size counts them all.
    assert card.parameter_count == sum(int(t.n_elements) for p in parts for t in gguf.GGUFReader(p).tensors)
    dirs = ModelDirs.from_options(tmp_path / "models")
    stored = store_import(
        dirs, ModelId("local/big"), files, replace=False, on_progress=lambda *_: None, cancel=threading.Event()
    )
    directory = stored.directory
    assert stored.size_bytes == card.storage_size_bytes
    assert stored.sha256 == hashlib.sha256(parts[0].read_bytes()).hexdigest()  # the first part names the model
    assert sorted(p.name for p in directory.iterdir()) == [
        ".jetshard-manifest.json",
        "model-00001-of-00003.gguf",
        "model-00002-of-00003.gguf",
        "model-00003-of-00003.gguf",
        "model.gguf",
    ]
    assert (directory / "model.gguf").resolve() == directory / "model-00001-of-00003.gguf"
    assert find_model(dirs, "local/big") is not None


def test_an_import_takes_the_place_of_leftovers_no_manifest_vouches_for(tmp_path: Path) -> None:
    """A Hub GGUF download interrupted under the id (its card deleted since) left its model directory holding only
    the download folder: the import takes that directory's place, as a conversion or a fetch does."""
    source = write_gguf(tmp_path / "m.gguf", "qwen3")
    dirs = ModelDirs.from_options(tmp_path / "models")
    leftover = tmp_path / "models" / "local--m" / ".jetshard-download"
    leftover.mkdir(parents=True)
    (leftover / "m-Q4_K_M.gguf").write_bytes(b"GGUF partial")
    _, files = read_import(ModelId("local/m"), source, None)
    directory = store_import(
        dirs, ModelId("local/m"), files, replace=False, on_progress=lambda *_: None, cancel=threading.Event()
    ).directory
    assert directory == tmp_path / "models" / "local--m"
    assert sorted(p.name for p in directory.iterdir()) == [".jetshard-manifest.json", "model.gguf"]
    assert find_model(dirs, "local/m") is not None


def test_an_import_through_a_link_stores_the_file_it_names(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot names its file by a relative link to a blob (the dashboard sends that path as
    it is): the stored copy is the file, not the link, and outlives the cache."""
    snapshot, blobs = (
        tmp_path / "hub" / "models--org--m" / "snapshots" / "abc",
        tmp_path / "hub" / "models--org--m" / "blobs",
    )
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    blob = write_gguf(blobs / "deadbeef", "qwen3")
    (snapshot / "m-Q4_K_M.gguf").symlink_to(Path("..", "..", "blobs", "deadbeef"))
    dirs = ModelDirs.from_options(tmp_path / "models")
    _, files = read_import(ModelId("local/m"), snapshot / "m-Q4_K_M.gguf", None)
    kept = blob.read_bytes()
    directory = store_import(
        dirs, ModelId("local/m"), files, replace=False, on_progress=lambda *_: None, cancel=threading.Event()
    ).directory
    shutil.rmtree(tmp_path / "hub")
    stored = directory / "model.gguf"
    assert not stored.is_symlink() and stored.read_bytes() == kept


NODE = NodeId("n1")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/me/Downloads/Qwen3-0.6B-Q4_K_M.gguf", "local/Qwen3-0.6B-Q4_K_M"),
        ("my smol (copy).gguf", "local/my-smol-copy"),
        ("/x/__odd..name--.GGUF", "local/odd-name"),
        ("/x/" + "long" * 40 + ".gguf", "local/" + ("long" * 10) + "-" + ("long" * 10)[1:]),
        # Cut in the middle: the quantization at its end tells the files of one model apart.
        (
            "/x/Meta-Llama-3.1-8B-Instruct-abliterated-uncensored-roleplay-finetune-v2.5-experimental-imatrix-Q4_K_M.gguf",
            "local/Meta-Llama-3.1-8B-Instruct-abliterated-v2.5-experimental-imatrix-Q4_K_M",
        ),
        ("/x/Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf", "local/Qwen3-30B-A3B-Q4_K_M"),
    ],
)
def test_an_imported_file_is_served_as_local_and_its_name_by_default(path: str, expected: str) -> None:
    assert import_model_id(None, path) == expected
    assert import_model_id("me/mine", path) == "me/mine"
    with pytest.raises(ValueError, match=r"'---\.gguf' leaves nothing to name the model by: give it an id"):
        import_model_id(None, "/x/---.gguf")


def test_an_import_report_adds_the_card_and_the_copy_on_its_node() -> None:
    profile = NodeProfile(hostname="h", os="linux", cpu_cores=1, memory_total_bytes=2**30, memory_available_bytes=2**30)
    state = fold(NodeJoined(node_id=NODE, session_id="s", profile=profile))
    ctx = Context(command_id=CommandId("c1"), now_ms=0)
    request = ImportModelFile(import_id="i1", node_id=NODE, model_id=ModelId("local/m"), path="/data/m.gguf")
    relative = handle(
        state, ImportModelFile(import_id="i0", node_id=NODE, model_id=ModelId("local/m"), path="m.gguf"), ctx
    )
    assert "must be an absolute path" in relative[0].reason  # type: ignore[union-attr]
    state = fold(*handle(state, request, ctx), state=state)
    assert state.imports[ModelId("local/m")].progress.status is ImportStatus.ONGOING
    card = tiny_card(
        "local/m",
        architecture="qwen3",
        storage_size_bytes=1000,
        source=ModelSource.LOCAL_GGUF,
        source_ref="/data/m.gguf",
        formats=(ModelFormat.GGUF,),
        file_type="Q4_K_M",
    )
    done = ImportProgress(
        status=ImportStatus.COMPLETED, bytes_done=1000, bytes_total=1000, directory="/models/local--m"
    )
    report = ReportModelImport(node_id=NODE, import_id="i1", model_id=ModelId("local/m"), progress=done, card=card)
    emitted = handle(state, report, ctx)
    assert [type(e) for e in emitted] == [CustomModelCardAdded, DownloadCompleted, ModelImportProgressed]
    state = fold(*emitted, state=state)
    assert state.custom_cards[ModelId("local/m")].is_custom
    assert state.download(NODE, ModelId("local/m")).progress.status is DownloadStatus.COMPLETED  # type: ignore[union-attr]
    again = handle(state, request, ctx)
    assert "already stored in /models/local--m; import it with replace" in again[0].reason  # type: ignore[union-attr]
    # A progress report the import's end overtook (its publish retried) changes nothing: the import stays completed,
    # so the next import under this id is not refused as one still running.
    late = ImportProgress(status=ImportStatus.ONGOING, bytes_done=500, bytes_total=1000)
    assert handle(state, msgspec.structs.replace(report, progress=late, card=None), ctx) == []
    assert handle(state, report, ctx) == []  # nor does the end reported twice
    replacing = msgspec.structs.replace(request, import_id="i2", replace=True)
    assert [type(e) for e in handle(state, replacing, ctx)] == [ModelImportRequested]
    # Not from under an instance's runners: the files they load (or convert) would go.
    shard = ShardAssignment(node_id=NODE, rank=0, start_layer=0, end_layer=card.num_layers)
    state = fold(InstancePlaced(instance_id="inst-1", model_id=ModelId("local/m"), shards=(shard,)), state=state)
    refused = handle(state, replacing, ctx)
    assert refused[0].reason == f"local/m is in use by instance(s) inst-1 on {NODE}; delete them first"  # type: ignore[union-attr]


async def test_import_gguf_runs_on_the_nodes_downloader_and_refuses_bad_files(cluster: Cluster, tmp_path: Path) -> None:
    config, models = tmp_path / "node", tmp_path / "models"
    node = await cluster.join(config)
    downloader = cluster.start_downloader("downloader", config, "--offline", "--default-models-dir", str(models))
    api = cluster.start_api()
    # The CLI writes nothing itself: its models directory is not the downloader's.
    env = {**cluster.env, "JETSHARD_CONFIG_DIR": str(config), "JETSHARD_DEFAULT_MODELS_DIR": str(tmp_path / "cli")}

    def import_gguf(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "jetshard", "models", "--api", api, "import-gguf", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    qwen = write_gguf(tmp_path / "Qwen3-Q4_K_M.gguf", "qwen3", context=40960, template=QWEN3_TEMPLATE)
    result = await asyncio.to_thread(import_gguf, str(qwen), "--id", "local/qwen")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported local/qwen (Q4_K_M, llama.cpp only)" in result.stdout
    stored = models / "local--qwen" / "model.gguf"
    assert stored.read_bytes() == qwen.read_bytes() and not (tmp_path / "cli").exists()
    async with httpx.AsyncClient() as http:
        card = (await http.get(f"{api}/models/local/qwen")).json()
    assert card["formats"] == ["gguf"] and card["file_type"] == "Q4_K_M" and card["source"] == "local-gguf"
    assert card["downloads"][node]["progress"]["status"] == "completed"
    assert card["downloads"][node]["progress"]["directory"] == str(models / "local--qwen")

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(qwen.read_bytes()[:-64])
    unknown = write_gguf(tmp_path / "unknown.gguf", "transmogrifier")
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(os.urandom(4096))
    for bad, problem in (
        (truncated, "the file is truncated"),
        (unknown, "architecture 'transmogrifier' is not one llama.cpp knows"),
        (not_gguf, "does not start with the GGUF magic bytes"),
    ):
        refused = await asyncio.to_thread(import_gguf, str(bad), "--id", "local/bad")
        assert refused.returncode == 1 and problem in refused.stderr, refused.stderr
    # A file name that leaves no id: both ask for one.
    kept, nameless = qwen.read_bytes(), tmp_path / "---.gguf"
    nameless.write_bytes(kept)
    refused = await asyncio.to_thread(import_gguf, str(nameless))
    assert refused.returncode == 2 and "--id" in refused.stderr and "give it an id" in refused.stderr, refused.stderr
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api}/models/import", json={"node_id": node, "path": str(nameless)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model_id"
    assert "'---.gguf' leaves nothing to name the model by: give it an id" in response.json()["error"]["message"]
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api}/models/import", json={"node_id": node, "path": "/" + "x" * 5000})
    assert response.status_code == 400 and response.json()["error"]["param"] == "path", response.text
    # A file rewritten since (a new file in its place, as tools write them) and truncated: the re-import is refused
    # and the copy stored before stays as it was, with nothing left beside it.
    truncated.replace(qwen)
    refused = await asyncio.to_thread(import_gguf, str(qwen), "--id", "local/qwen", "--replace")
    assert refused.returncode == 1 and "the file is truncated" in refused.stderr, refused.stderr
    assert stored.read_bytes() == kept
    assert sorted(p.name for p in models.iterdir()) == ["local--qwen"]
    other = await asyncio.to_thread(import_gguf, str(unknown), "--id", "local/qwen", "--replace")
    assert other.returncode == 1 and "local/qwen was imported from" in other.stderr
    # Without --replace a stored copy is never written over; with it, it is replaced in one step.
    qwen.write_bytes(kept)
    again = await asyncio.to_thread(import_gguf, str(qwen), "--id", "local/qwen")
    assert again.returncode == 1 and "already stored in" in again.stderr and "--replace" in again.stderr
    replaced = await asyncio.to_thread(import_gguf, str(qwen), "--id", "local/qwen", "--replace")
    assert replaced.returncode == 0, replaced.stderr
    assert stored.read_bytes() == kept and sorted(p.name for p in models.iterdir()) == ["local--qwen"]

    # Ctrl-C while it waits (here on a paused downloader) ends the command at once; the import goes on without it.
    os.killpg(downloader.pid, signal.SIGSTOP)
    try:
        args = ["-m", "jetshard", "models", "--api", api, "import-gguf", str(qwen), "--id", "local/q"]
        waiting = await asyncio.create_subprocess_exec(sys.executable, *args, env=env, stderr=subprocess.PIPE)
        await cluster.wait(lambda s: "local/q" in s.imports, what="the import to be asked for")
        await asyncio.sleep(1.5)  # a poll of its progress under way
        waiting.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(waiting.communicate(), timeout=5)
        assert waiting.returncode == 1 and b"Aborted" in stderr, stderr
    finally:
        os.killpg(downloader.pid, signal.SIGCONT)
    await cluster.wait(lambda s: "local/q" in s.custom_cards, what="the import to finish on its node")


@pytest.mark.parametrize(("field", "offset"), [("tensor count", 8), ("metadata count", 16)])
def test_a_header_claiming_more_entries_than_any_model_is_refused_before_it_is_walked(field: str, offset: int) -> None:
    """Counts a file's size would allow (a sparse file can be any size) but no model has: refused at once, before the
    reader builds a table of them."""
    header = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    struct.pack_into("<Q", header, offset, 1 << 24)
    with pytest.raises(ValueError, match=f"the {field} is {1 << 24}; no model has more"):
        parse_gguf_header(bytes(header), 1 << 40)
