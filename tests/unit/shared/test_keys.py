"""Key names on one Redis (unchanged) and on a cluster (hash tags): the keys one operation touches
share a hash slot, and stream names parse back to their parts in both."""

import inspect

import pytest
from redis.crc import key_slot

from shared import queues
from shared.keys import Keys

ONE, CLUSTER = Keys(), Keys(cluster=True)


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_one_redis_keeps_the_names_it_always_had():
    assert ONE.jobs("m", "batch", "high") == "cortex:jobs:m:batch:high"
    assert (
        ONE.node_jobs("m", "n") == "cortex:jobs:m:@n"
        and ONE.moved_jobs("m") == "cortex:jobs:m:moved"
    )
    assert (ONE.events("j"), ONE.nodes(), ONE.file("f"), ONE.api_key("k")) == (
        "cortex:events:j",
        "cortex:nodes",
        "cortex:file:f",
        "cortex:apikey:k",
    )


def test_every_cluster_key_but_the_lone_ones_carries_a_hash_tag():
    lone = {
        "prefixes",
        "prefix_tiers",
        "session",
        "routing",
        "cancel",
        "newcomers",
        "arq_queue",
        "all_jobs",
        "all_waiting",
        "stream_suffix",
        "moved_of",
        "shared_of",
    }
    for name, method in inspect.getmembers(Keys, inspect.isfunction):
        if name.startswith("_") or name in lone:
            continue
        args = ["x"] * (len(inspect.signature(method).parameters) - 1)
        key = getattr(CLUSTER, name)(*args)
        assert "{" in key and key.index("}") > key.index("{") + 1, (name, key)


@pytest.mark.parametrize(
    "group",
    [
        [CLUSTER.jobs("m", c, b) for c in queues.CLASSES for b in queues.BANDS]
        + [
            CLUSTER.node_jobs("m", "n", "batch", "low"),
            CLUSTER.moved_jobs("m", "interactive", "high"),
            CLUSTER.waiting_keys("m", "batch", "low"),
            CLUSTER.waiting_room("m", "key-1", "interactive", "normal"),
        ],
        [CLUSTER.events("j"), CLUSTER.event_log("j"), CLUSTER.detached("j")],
        [
            CLUSTER.node("n"),
            CLUSTER.nodes(),
            CLUSTER.started("n"),
            CLUSTER.cmd("n"),
            CLUSTER.catalog(),
        ],
        [CLUSTER.response("r"), CLUSTER.background_responses()],
        [CLUSTER.file("f"), CLUSTER.files(), CLUSTER.files_bytes()],
        [
            CLUSTER.batch("b"),
            CLUSTER.batches(),
            CLUSTER.batches_active(),
            CLUSTER.batch_lines("b", "out"),
            CLUSTER.batch_lease("b"),
        ],
        [
            CLUSTER.api_key("k"),
            CLUSTER.api_keys(),
            CLUSTER.rate_window("k", "requests"),
            CLUSTER.daily_tokens("k", "d"),
            CLUSTER.metered("j"),
        ],
    ],
    ids=["model streams", "job", "fleet", "responses", "files", "batches", "api keys"],
)
def test_what_one_operation_touches_shares_a_slot(group):
    assert len({slot(key) for key in group}) == 1, group


def test_models_and_jobs_spread_over_slots():
    assert len({slot(CLUSTER.jobs(f"model-{i}")) for i in range(32)}) > 24
    assert len({slot(CLUSTER.events(f"job-{i}")) for i in range(32)}) > 24


@pytest.mark.parametrize("keys", [ONE, CLUSTER], ids=["one Redis", "cluster"])
def test_stream_names_parse_back(keys):
    assert queues.parse(keys, keys.jobs("org/model:v1", "batch", "high")) == queues.StreamName(
        "org/model:v1", "batch", "high"
    )
    assert queues.parse(
        keys, keys.node_jobs("m", "node-a", "interactive", "low")
    ) == queues.StreamName("m", "interactive", "low", node="node-a")
    assert queues.parse(keys, keys.moved_jobs("m")) == queues.StreamName(
        "m", "interactive", "normal", moved=True
    )
    assert queues.parse(keys, keys.events("j")) is None
    assert queues.homes(keys.node_jobs("m", "node-a", "batch", "low")) == [
        keys.node_jobs("m", "node-a", "batch", "low"),
        keys.moved_jobs("m", "batch", "low"),
    ]
    assert queues.homes(keys.jobs("m")) == [keys.jobs("m")]
