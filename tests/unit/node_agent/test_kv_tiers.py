"""The KV tiers below the device pool (node_agent/engine/kv_tiers.py, kv_disk.py, and the runner's
copies in node_agent/model/kv_host.py): blocks the device pool evicts are kept in host memory and on
disk and copied back instead of recomputed, greedy-equal to the uncached full forward, with
preemption and mixed batches; a restarted engine finds its prefixes on disk; a corrupt, partial or
foreign file is never loaded."""

import logging
import shutil

import pytest

from node_agent.engine.engine import Engine
from node_agent.engine.kv_disk import DiskTier
from node_agent.model import loader
from shared import prefix_marks
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, add, full_forward_greedy, request, run

SYSTEM = " ".join(PROMPTS) * 2


def chat(job: str, agent: int, *turns: str, max_tokens: int = 8):
    """Agent `agent`'s conversation: its own system prompt (no block shared with another agent's)."""
    req = request(job, temperature=0, ignore_eos=True, max_tokens=max_tokens)
    req.messages = [{"role": "system", "content": f"Agent {agent}. {SYSTEM}"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return req


def tokens(results) -> dict:
    return {job: r.token_ids[0] for job, r in results.items()}


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory, smol_tokenizer):
    """A tiny llama whose keys and values take 2 KB a token, so that the smallest budget
    (`kv_cache_mb` 1) is a device pool of 32 blocks (512 tokens: one agent's conversation and a
    little more) under 4 slots of 512 tokens: decode can run out of blocks."""
    folder = tiny_models.build(
        "llama",
        tmp_path_factory.mktemp("tiers") / "llama",
        smol_tokenizer,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    profile = tiny_profile(folder, slots=4, max_model_len=512, kv_cache_mb=1)
    return profile, loader.load(profile, "cpu")


def uncached(profile, lm, *requests) -> dict:
    """Each request's tokens from an engine without prefix caching, each alone."""
    off = profile.model_copy(update={"prefix_caching": False})
    return {r.job: tokens(run(Engine(lm, off), r))[r.job] for r in requests}


def turns(agents: int, turn: int) -> list:
    """Every agent's request at `turn` (0: the first), earlier answers fixed text."""
    said = [x for t in range(turn) for x in (PROMPTS[t % len(PROMPTS)], "Sure.")]
    return [
        chat(f"a{a}t{turn}", a, *said, PROMPTS[turn % len(PROMPTS)], max_tokens=64)
        for a in range(agents)
    ]


def test_blocks_restored_from_host_memory_give_the_uncached_tokens(small_pool):
    profile, lm = small_pool
    engine = Engine(lm, profile.model_copy(update={"kv_host_mb": 4}))
    tiers = engine.scheduler.tiers
    assert engine.pool.blocks == 32 and tiers.host.slots >= 4 * engine.pool.blocks
    first, later = turns(4, 0), turns(4, 1)
    run(engine, *first, join_every=3)
    warm = run(engine, *later, join_every=3)  # each joins a running batch: mixed steps
    stats = engine.kv_stats()
    assert tokens(warm) == uncached(profile, lm, *later)
    assert stats.host_hits > 0 and stats.restored_bytes > 0 and stats.offloaded_bytes > 0
    assert stats.preemptions > 0  # four agents' turns in 32 blocks: decode ran out of them
    assert sum(r.done.usage.cached_tokens for r in warm.values()) == stats.prefix_hits
    assert not engine.scheduler.jobs and engine.pool.used == 0


def test_without_the_host_tier_the_same_turns_recompute(small_pool):
    profile, lm = small_pool
    engine = Engine(lm, profile)
    assert engine.scheduler.tiers is None
    run(engine, *turns(4, 0), join_every=3)
    warm = run(engine, *turns(4, 1), join_every=3)
    with_host = Engine(lm, profile.model_copy(update={"kv_host_mb": 4}))
    run(with_host, *turns(4, 0), join_every=3)
    run(with_host, *turns(4, 1), join_every=3)
    cached = sum(r.done.usage.cached_tokens for r in warm.values())
    assert with_host.kv_stats().prefix_hits > cached  # what the device pool alone lost


def test_a_restored_prefix_equals_the_full_forward(small_pool):
    profile, lm = small_pool
    engine = Engine(lm, profile.model_copy(update={"kv_host_mb": 4}))
    run(engine, chat("first", 0, "Hello there"))
    for a in range(1, 6):  # other agents push the first out of the device pool
        run(engine, chat(f"o{a}", a, "Hello there", max_tokens=24))
    later = chat("later", 0, "Hello there", "Hi!", "Why?", max_tokens=12)
    add(engine, later)
    ids = list(engine.scheduler.jobs["later"].sequences[0].tokens)
    got = []
    while engine.has_work:
        for _, events in engine.step():
            got += [t for e in events for c in getattr(e, "choices", []) for t in c.token_ids]
    assert engine.kv_stats().host_hits >= 6 * profile.block_size
    assert got == full_forward_greedy(lm, ids, 12)


def test_marks_follow_their_blocks_down_to_host_memory_and_back(small_pool):
    profile, lm = small_pool
    engine = Engine(lm, profile.model_copy(update={"kv_host_mb": 4}))
    req = chat("m0", 0, "Hello there", max_tokens=2)
    req.prefix_marks = prefix_marks.marks(req)
    marks = {mark for mark, _ in req.prefix_marks}
    changes: dict[str, str] = {}

    def drive(*requests) -> list[str]:
        for r in requests:
            add(engine, r)
        dropped = []
        while engine.has_work:
            out = engine.core_step()
            changes.update(out.tiers)
            dropped += out.dropped
            engine.stop(engine.output.process(out)[1])
        return dropped

    drive(req)
    dropped = drive(*[chat(f"o{a}", a, "Hello there", max_tokens=24) for a in range(1, 6)])
    assert not marks & set(dropped) and {changes.get(m) for m in marks} == {"host"}
    again = chat("m1", 0, "Hello there", max_tokens=2)
    drive(again)
    assert {changes[m] for m in marks} == {"device"}


# ---- disk ---------------------------------------------------------------------------------------


def test_a_restarted_engine_reads_its_prefixes_from_disk(small_pool, tmp_path):
    profile, lm = small_pool
    first = Engine(lm, profile, kv_disk=(tmp_path, 1.0))
    run(first, chat("before", 0, "Hello there"))
    written = first.kv_stats().disk_written_bytes
    first.scheduler.tiers.close()  # as the engine's drop_model does: its files are written by then
    assert written > 0 and len(list(tmp_path.rglob("*.kv"))) >= 6
    later = chat("after", 0, "Hello there", "Hi!", "Why?", max_tokens=12)
    restarted = Engine(lm, profile, kv_disk=(tmp_path, 1.0))
    warm = run(restarted, later)
    stats = restarted.kv_stats()
    assert stats.disk_hits >= 6 * profile.block_size and stats.disk_read_bytes > 0
    assert warm["after"].done.usage.cached_tokens == stats.prefix_hits
    assert tokens(warm) == uncached(profile, lm, later)


def test_a_block_of_another_revision_is_never_used(small_pool, tmp_path, caplog):
    """Same model id and dtype (so the same hash chain, the same file names), another source
    revision: its files copied where this one looks are refused by their header."""
    profile, lm = small_pool
    first = Engine(lm, profile, kv_disk=(tmp_path, 1.0))
    run(first, chat("before", 0, "Hello there"))
    first.scheduler.tiers.close()
    other = profile.model_copy(update={"source": profile.source + "@other-revision"})
    engine = Engine(lm, other, kv_disk=(tmp_path, 1.0))
    (theirs,) = [p for p in tmp_path.iterdir() if p != engine.scheduler.tiers.disk.folder]
    for path in theirs.glob("*.kv"):
        shutil.copy(path, engine.scheduler.tiers.disk.folder / path.name)
    engine.scheduler.tiers.disk.__init__(  # it looks again, finding the copies
        tmp_path, engine.scheduler.tiers.disk.identity, 1 << 30, engine.scheduler.tiers.block_bytes
    )
    later = chat("after", 0, "Hello there", "Hi!", max_tokens=8)
    with caplog.at_level(logging.WARNING, logger="node_agent.engine.kv_disk"):
        warm = run(engine, later)
    assert engine.kv_stats().disk_hits == 0
    assert "another cache's block (source" in caplog.text
    assert tokens(warm) == uncached(profile, lm, later)


IDENTITY = dict(format=1, model="m", source="/models/m", quant="none", dtype="torch.float32")


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "other"),
        ("source", "/models/m@rev2"),
        ("dtype", "torch.bfloat16"),
        ("quant", "int8"),
    ],
)
def test_a_file_of_another_model_revision_dtype_or_quant_is_refused(tmp_path, caplog, field, value):
    ours = DiskTier(tmp_path, IDENTITY, 1 << 20, 8)
    theirs = DiskTier(tmp_path, IDENTITY | {field: value}, 1 << 20, 8)
    assert theirs.folder != ours.folder  # content-addressed by identity: never the same file
    theirs.claim(b"h" * 16)
    theirs.write(b"h" * 16, b"12345678")
    theirs.flush()
    shutil.copy(theirs.path(b"h" * 16), ours.path(b"h" * 16))
    ours.files[b"h" * 16] = 1
    with caplog.at_level(logging.WARNING, logger="node_agent.engine.kv_disk"):
        assert ours.read(b"h" * 16) is None
    assert f"another cache's block ({field}" in caplog.text and not ours.has(b"h" * 16)
    assert theirs.read(b"h" * 16) == b"12345678"


@pytest.mark.parametrize("damage", ["corrupt", "partial", "other block", "not ours"])
def test_a_corrupt_or_partial_file_is_ignored_with_a_log_line(tmp_path, caplog, damage):
    tier = DiskTier(tmp_path, IDENTITY, 1 << 20, 8)
    tier.claim(b"a" * 16)
    tier.write(b"a" * 16, b"abcdefgh")
    tier.flush()
    path = tier.path(b"a" * 16)
    data = path.read_bytes()
    broken = {
        "corrupt": data[:-1] + b"X",
        "partial": data[:-3],
        "other block": data.replace(b"61" * 16, b"62" * 16),
        "not ours": b"hello" + data,
    }[damage]
    path.write_bytes(broken)
    with caplog.at_level(logging.WARNING, logger="node_agent.engine.kv_disk"):
        assert tier.read(b"a" * 16) is None
    assert "ignoring" in caplog.text and not tier.has(b"a" * 16)


def test_the_disk_tier_keeps_to_its_budget_least_recently_used_first(tmp_path):
    size = DiskTier(tmp_path / "measure", IDENTITY, 1 << 20, 100)
    size.claim(b"x" * 16)
    size.write(b"x" * 16, b"x" * 100)
    tier = DiskTier(tmp_path, IDENTITY, 3 * size.files[b"x" * 16], 100)
    for i in range(3):
        tier.claim(bytes([i]) * 16)
        assert tier.write(bytes([i]) * 16, bytes([i]) * 100) == []
    tier.flush()
    assert tier.read(b"\0" * 16) == b"\0" * 100  # the oldest, used again
    tier.claim(b"\3" * 16)
    assert tier.write(b"\3" * 16, b"\3" * 100) == [b"\1" * 16]
    tier.flush()
    assert sorted(p.stem[:2] for p in tier.folder.glob("*.kv")) == ["00", "02", "03"]
    again = DiskTier(tmp_path, IDENTITY, 3 * size.files[b"x" * 16], 100)  # a restart finds them
    assert again.has(b"\2" * 16) and again.read(b"\3" * 16) == b"\3" * 100
