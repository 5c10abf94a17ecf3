"""A whole Cortex on a local Redis Cluster (3 masters, 3 replicas; tests/redis_cluster.py): a
gateway, a node serving a tiny random model, a batch worker whose queue (arq) is on a single
redis-server, as `CORTEX_BATCH_REDIS_URL` names it."""

from collections.abc import Iterator

import pytest

from tests.integration.batch.conftest import models_toml
from tests.stack import Stack, start_cluster_stack

ADMIN_KEY = "cluster-admin-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    stack = start_cluster_stack(
        tmp_path_factory.mktemp("cluster"),
        models_toml(tiny_dirs["llama"]),
        CORTEX_ADMIN_KEY=ADMIN_KEY,
        CORTEX_ARQ_POLL_DELAY_S="0.1",
        CORTEX_TORCH_THREADS="1",
        CORTEX_BATCH_LEASE_S="2",
        CORTEX_BATCH_RESUME_EVERY_S="1",
        CORTEX_DISCONNECT_GRACE_S="0",
        # a node frozen through a failover (SIGSTOP) stays alive to the gateways
        CORTEX_NODE_TTL_S="15",
        CORTEX_HEARTBEAT_TTL_S="15",
    )
    try:
        stack.start_gateway()
        stack.nodes = {"node-a": stack.start_node("node-a", [MODEL])}
        stack.start_batch_worker()
        yield stack
    finally:
        stack.stop()
