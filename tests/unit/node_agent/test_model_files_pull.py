"""What a pull fetches and checks, and what the disk budget deletes: the file selection, the hash
checks (sha256 for LFS files, git blob ids for the others) and the eviction order, on real files."""

import hashlib
import os

import pytest

from node_agent.weights import disk_budget, hashes
from node_agent.weights.selection import needed_files
from shared.errors import DiskBudgetExceeded, InvalidRequest, ModelFileCorrupt
from shared.heartbeat import ModelInfo, NodeHeartbeat
from shared.lifecycle import ModelState
from shared.model_store import FileEntry, HubRef, Manifest, ModelStore

SIDE = ["config.json", "tokenizer.json", "tokenizer_config.json"]


def test_selection_takes_one_weight_format_and_the_side_files_at_the_top_only():
    repo = [
        *SIDE,
        "README.md",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "onnx/model.onnx",
        "original/consolidated.pth",
    ]
    assert needed_files(repo) == sorted(
        [
            *SIDE,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    assert needed_files([*SIDE, "pytorch_model.bin"]) == sorted([*SIDE, "pytorch_model.bin"])


def test_selection_of_gguf_repos_takes_the_one_file_or_the_one_named():
    assert needed_files(["README.md", "m.Q4_0.gguf"]) == ["m.Q4_0.gguf"]
    assert needed_files(["a.Q4_0.gguf", "a.Q8_0.gguf"], "a.Q8_0.gguf") == ["a.Q8_0.gguf"]
    with pytest.raises(InvalidRequest, match="name one with gguf_file"):
        needed_files(["a.Q4_0.gguf", "a.Q8_0.gguf"], source="hf:o/a")
    with pytest.raises(InvalidRequest, match="is not in the repo"):
        needed_files(["a.Q4_0.gguf"], "a.Q8_0.gguf")
    with pytest.raises(InvalidRequest, match="no weights"):
        needed_files(["README.md", "config.json"])


def test_hub_sources_name_their_folders():
    assert HubRef.parse("hf:org/name").folder == "org--name"
    assert HubRef.parse("hf:org/name@v2").model_dump() == {"repo": "org/name", "revision": "v2"}
    assert HubRef.parse("hf:org/name@v2").folder == "org--name@v2"
    for bad in ("hf:", "hf:a/b/c", "hf:../x", "/models/x"):
        with pytest.raises(InvalidRequest):
            HubRef.parse(bad)


def test_a_file_is_checked_by_size_then_by_its_hub_hash(tmp_path):
    data = b"weights" * 100
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    hashes.check(
        path,
        FileEntry(name=path.name, size=len(data), sha256=hashlib.sha256(data).hexdigest()),
        "s",
    )
    blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
    hashes.check(
        path, FileEntry(name=path.name, size=len(data), blob_id=blob), "s"
    )  # what `git hash-object` gives
    with pytest.raises(ModelFileCorrupt, match="sha256"):
        hashes.check(path, FileEntry(name=path.name, size=len(data), sha256="0" * 64), "s")
    assert not path.exists()  # deleted: never loaded, fetched whole next time
    path.write_bytes(data[:-1])
    with pytest.raises(ModelFileCorrupt, match=f"is {len(data) - 1} bytes"):
        hashes.check(path, FileEntry(name=path.name, size=len(data), blob_id=blob), "s")


def folder(store: ModelStore, name: str, size: int, last_used: float, whole: bool = True) -> None:
    root = store.folder(name)
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"x" * size)
    if whole:
        store.complete(
            Manifest(
                source=f"hf:org/{name.removeprefix('org--')}",
                commit="c",
                files=[FileEntry(name="model.safetensors", size=size, sha256="s")],
            )
        )
        os.utime(root / "cortex-last-used", (last_used, last_used))


def test_room_is_made_from_interrupted_pulls_first_then_the_least_recently_used(tmp_path):
    store = ModelStore(tmp_path)
    folder(store, "org--old", 300, last_used=1000)
    folder(store, "org--new", 300, last_used=2000)
    folder(store, "org--half", 100, last_used=0, whole=False)
    assert disk_budget.make_room(store, "org--next", 400, 1000, {}, "hf:org/next") == [
        "org--half",
        "org--old",
    ]
    assert sorted(store.held()) == ["org--new"]


def test_a_pull_that_cannot_fit_names_what_holds_the_disk(tmp_path):
    store = ModelStore(tmp_path)
    folder(store, "org--loaded", 600, last_used=1000)
    with pytest.raises(DiskBudgetExceeded, match=r"org--loaded \(0.0 MB, m is ready here\)"):
        disk_budget.make_room(
            store, "org--next", 500, 1000, {"org--loaded": "m is ready here"}, "hf:org/next"
        )
    assert (
        disk_budget.make_room(store, "org--next", 500, None, {}, "hf:org/next") == []
    )  # no budget
    assert sorted(store.held()) == ["org--loaded"]


def test_pulls_in_flight_hold_their_whole_size_in_the_budget(tmp_path):
    """Two pulls at once must not overshoot `models_disk_gb`: a pull still transferring counts at
    the size it will have (its reservation), not at the bytes it has written so far, and is never
    deleted to make room."""
    store = ModelStore(tmp_path)
    folder(store, "org--coming", 100, last_used=0, whole=False)  # 100 of its 600 bytes so far
    reserved = {"org--coming": 600}
    with pytest.raises(DiskBudgetExceeded, match=r"org--coming \(0.0 MB, being pulled\)"):
        disk_budget.make_room(
            store, "org--next", 500, 1000, {"org--coming": "being pulled"}, "hf:org/next", reserved
        )
    assert (
        disk_budget.make_room(
            store, "org--next", 400, 1000, {"org--coming": "being pulled"}, "hf:org/next", reserved
        )
        == []
    )  # 600 + 400 fit
    assert disk_budget.make_room(
        store, "org--next", 400, 1000, {}, "hf:org/next", {"org--elsewhere": 600}
    ) == ["org--coming"]  # a reservation not yet on disk counts too; the half pull goes first


def test_a_replica_downloading_counts_as_one_coming():
    info = ModelInfo(state=ModelState.DOWNLOADING, device="cpu")
    assert NodeHeartbeat(
        node="n", version="", started_ms=0, heartbeat_ms=0, models={"m": info}
    ).serves("m")


def test_an_embedding_model_takes_its_sentence_transformers_modules():
    repo = [
        "config.json",
        "model.safetensors",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "1_Pooling/config.json",
        "onnx/model.onnx",
        "openvino/openvino_model.xml",
    ]
    assert needed_files(repo) == sorted(
        [
            "1_Pooling/config.json",
            "config.json",
            "model.safetensors",
            "modules.json",
            "sentence_bert_config.json",
            "tokenizer.json",
        ]
    )


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../b", "..", "a//b", "c\\d"])
def test_a_manifest_names_files_inside_its_folder_only(name):
    with pytest.raises(ValueError):
        FileEntry(name=name, size=1)
