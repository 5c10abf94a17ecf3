"""tests/redis_cluster.py starts a real 3-master, 1-replica Redis Cluster: keys spread over the
masters, a hash tag pins keys to one master, sharded pub/sub works on a channel's shard, and a killed
master's replica takes over with the data it acknowledged."""

import shutil
from pathlib import Path

import pytest
import redis

from tests.redis_cluster import running_cluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
        reason="redis-server and redis-cli must be on PATH (scripts/test installs them)",
    ),
]


def test_a_local_cluster_spreads_keys_shards_pubsub_and_fails_over(tmp_path: Path):
    with running_cluster(tmp_path, masters=3, replicas=1) as cluster:
        assert len(cluster.ports) == 6 and len(cluster.masters()) == 3
        assert cluster.url == "redis+cluster://" + ",".join(
            f"127.0.0.1:{port}" for port in cluster.ports
        )
        assert cluster.ports[0] in cluster.masters()

        client = cluster.client()
        keys = [f"key-{i}" for i in range(30)]
        for key in keys:
            client.set(key, key.upper())
        assert [client.get(key) for key in keys] == [key.upper() for key in keys]
        assert {cluster.master_port_of(key) for key in keys} == set(
            cluster.masters()
        )  # every master has some

        tagged = [f"{{m}}:{name}" for name in ("a", "b", "c")]
        owner = cluster.master_port_of("{m}")
        assert {cluster.master_port_of(key) for key in tagged} == {owner}

        # sharded pub/sub: subscribe on the channel's master, publish through the cluster client
        subscriber = redis.Redis(host="127.0.0.1", port=owner, decode_responses=True)
        pubsub = subscriber.pubsub()
        pubsub.ssubscribe("{m}:events")
        assert pubsub.get_message(timeout=2.0)["type"] == "ssubscribe"
        assert client.spublish("{m}:events", "x") == 1
        message = pubsub.get_message(timeout=2.0)
        assert message is not None and (message["type"], message["data"]) == ("smessage", "x")
        pubsub.close()
        subscriber.close()

        # the tagged keys reach the owner's replica before the owner dies
        for key in tagged:
            client.set(key, f"before-{key}")
        cluster.wait_replicated(owner)
        client.close()

        cluster.kill(owner)
        took = cluster.wait_for_failover(owner, timeout_s=30)
        new_owner = cluster.master_port_of("{m}")
        assert new_owner != owner and new_owner in cluster.masters()
        assert owner not in cluster.masters() and len(cluster.masters()) == 3

        after = cluster.client()
        assert [after.get(key) for key in tagged] == [f"before-{key}" for key in tagged]
        assert after.get(keys[0]) == keys[0].upper()
        after.close()
        counts = cluster.commands_per_node()
        assert (
            owner not in counts and len(counts) == 5 and all(calls > 0 for calls in counts.values())
        )
        assert took < 30
