"""Pulls trust neither a source's text nor a peer (node_agent/weights/peer_trust.py, shared/model_store.py):
a revision is a branch or tag name or a commit; every path stays inside the models directory once
links are resolved; a peer's manifest is used only where it matches the hub's (or the pinned
commit's); the fleet secret goes only to an http(s) file URL on the peer's own host."""

import asyncio
import logging
import socket
import time

import fakeredis
import pytest

from node_agent.weights import hub, peer_trust
from node_agent.weights.puller import Puller
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest, ModelPullFailed
from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.model_store import FileEntry, HubRef, Manifest, ModelStore, inside, partial_path
from shared.settings import NodeSettings

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    "source",
    [
        "hf:org/name@main/../../..",
        "hf:org/name@..",
        "hf:org/name@../x",
        "hf:org/name@a/b",
        "hf:org/name@",
        "hf:org/name@.hidden",
        "hf:org/name@-x",
        "hf:org/name@a b",
        "hf:org/name@main\x00",
        "hf:org/../name",
        "hf:org/na--me",
        "hf:/name",
        "hf:org/name/extra",
    ],
)
def test_a_source_that_is_not_a_repo_and_revision_is_refused(source):
    with pytest.raises(InvalidRequest, match="hf:org/name|revision"):
        HubRef.parse(source)


@pytest.mark.parametrize(
    ("source", "folder"),
    [
        ("hf:org/name", "org--name"),
        ("hf:gpt2", "gpt2"),
        ("hf:org/name@main", "org--name@main"),
        ("hf:org/name@v1.2_rc-3", "org--name@v1.2_rc-3"),
        (f"hf:org/name@{COMMIT}", f"org--name@{COMMIT}"),
    ],
)
def test_repos_branches_tags_and_commits_are_taken(source, folder):
    assert HubRef.parse(source).folder == folder
    assert HubRef.is_commit(HubRef.parse(source).revision) == source.endswith(COMMIT)


def test_every_folder_and_file_stays_inside_the_models_directory(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    store = ModelStore(root)
    for name in ("..", "a/b", ".", ""):
        with pytest.raises(ModelPullFailed):
            store.folder(name)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ModelPullFailed, match="not a folder inside"):
        store.folder("linked")
    assert "linked" not in store.usage()  # nor counted, nor evicted through its link
    folder = store.folder("org--name")
    folder.mkdir()
    (folder / "1_Pooling").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ModelPullFailed, match="outside its model folder"):
        inside(folder, "1_Pooling/config.json")
    (folder / ".cache").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ModelPullFailed, match="outside its model folder"):
        partial_path(folder, "model.safetensors")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "peer_host", "refused"),
    [
        ("http://node-a:8101", "node-a", ""),
        ("https://NODE-A:8101", "node-a", ""),
        ("http://127.0.0.1:8101", "here", ""),  # a peer on this host, on loopback
        ("http://127.0.0.1:8101", "node-a", "loopback"),
        ("http://localhost:8101", "node-a", "loopback"),
        ("http://attacker.invalid:8101", "node-a", "not on its host"),
        ("ftp://node-a:8101", "node-a", "not an http"),
        ("http://user:pw@node-a:8101", "node-a", "not an http"),
        ("http://node-a:99999", "node-a", "not a URL"),
        ("http://node-a:8101", "", "names no host"),
    ],
)
def test_the_fleet_secret_goes_only_to_a_file_url_on_the_peers_host(url, peer_host, refused):
    why = peer_trust.file_url_refusal(url, peer_host, "here")
    assert (refused in why and why) if refused else why == ""


def _manifest(source: str, commit: str = COMMIT, **sizes: int) -> Manifest:
    files = sizes or {"config.json": 10, "model.safetensors": 1000}
    return Manifest(
        source=source,
        commit=commit,
        files=[FileEntry(name=n, size=s, sha256=f"{s:064x}") for n, s in files.items()],
    )


def test_a_peers_manifest_is_used_only_where_it_matches_the_hubs_or_the_pinned_commit():
    source, pinned = "hf:org/name", f"hf:org/name@{COMMIT}"
    hubs = _manifest(source)
    assert peer_trust.accepted(_manifest(source), source, None, hubs) is hubs  # ours, not theirs
    refusals = {
        "another source": (_manifest("hf:org/other"), source, hubs),
        "another size": (
            _manifest(source, **{"config.json": 10, "model.safetensors": 9}),
            source,
            hubs,
        ),
        "another commit": (_manifest(source, commit="f" * 40), source, hubs),
        "no hub, no pin": (_manifest(source), source, None),
        "no hub, another commit": (_manifest(pinned, commit="f" * 40), pinned, None),
        "no hub, files it does not need": (
            _manifest(pinned, **{"config.json": 10, "model.safetensors": 9, "x.py": 1}),
            pinned,
            None,
        ),
    }
    for why, (offered, wanted, expected) in refusals.items():
        with pytest.raises(ModelPullFailed):
            peer_trust.accepted(offered, wanted, None, expected)
            pytest.fail(why)
    offered = _manifest(pinned)
    assert peer_trust.accepted(offered, pinned, None, None) is offered


@pytest.fixture
def listener():
    """A TCP port that records whatever connects to it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    yield server
    server.close()


async def test_a_peer_advertising_a_file_url_off_its_host_never_gets_the_secret(
    tmp_path, listener, monkeypatch, caplog
):
    def no_hub(source, gguf_file):
        raise ModelPullFailed(f"{source}: the hub's model info could not be read: unreachable")

    monkeypatch.setattr(hub, "manifest", no_hub)
    redis, keys = fakeredis.FakeAsyncRedis(), Keys()
    source = f"hf:org/name@{COMMIT}"
    folder = HubRef.parse(source).folder
    now = int(time.time() * 1000)
    evil = NodeHeartbeat.empty("evil").model_copy(
        update=dict(
            heartbeat_ms=now,
            host="elsewhere.invalid",
            file_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
        )
    )
    await redis.hset(keys.node("evil"), mapping=evil.to_hash())
    await redis.zadd(keys.nodes(), {"evil": now})
    await redis.hset(keys.model_files("evil"), folder, _manifest(source).model_dump_json())
    settings = NodeSettings(models_dir=tmp_path / "models", fleet_secret="s3cret")

    async def nothing_protected():
        return {}

    puller = Puller(settings, redis, keys, "me", nothing_protected)
    profile = ModelProfile(id="m", source=source, slots=1, max_model_len=64)
    with caplog.at_level(logging.WARNING):
        pull = puller.start(profile)
        with pytest.raises(ModelPullFailed):  # no other peer, no hub
            await asyncio.wait_for(pull.wait(), 30)
    with pytest.raises(TimeoutError):
        listener.accept()  # nobody came
    assert "not fetching from peer evil" in caplog.text and "loopback" in caplog.text
    assert not (tmp_path / "models" / folder / "model.safetensors").exists()
