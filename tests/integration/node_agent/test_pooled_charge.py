"""Every job kind is charged where it ends: an embedding job cancelled on the node (its client left)
counts its inputs' tokens against its API key, as a cancelled chat counts what it used; otherwise a
client could embed at no cost by leaving before the answer. A real node agent and redis-server."""

import asyncio
import time

import redis.asyncio as aioredis

from shared.api_keys import utc_day
from shared.redis_conn import publish
from shared.wire import PoolingRequest, StreamEntry, pack, unpack_event
from tests import tiny_poolers
from tests.conftest import eventually
from tests.node_agents import agent_serving

TEXT = "the sea and the sky " * 24


async def test_a_cancelled_embedding_job_is_charged_its_inputs(redis_url, tmp_path):
    source = tiny_poolers.build_embedder(tmp_path / "slow", layers=12)
    toml = (
        f'[[models]]\nid = "embed-slow"\nkind = "embedding"\nsource = "{source}"\n'
        'dtype = "float32"\nmax_model_len = 128\npooling_batch_tokens = 16\n'
    )
    r = aioredis.Redis.from_url(redis_url)
    try:
        async with agent_serving(redis_url, tmp_path, toml, "embed-slow") as agent:
            keys, served = agent.keys, agent.models["embed-slow"]
            events = r.pubsub()
            await events.subscribe(keys.events("leaver"))
            request = PoolingRequest(
                job="leaver", model="embed-slow", kind="embed", inputs=[TEXT] * 512
            )
            entry = StreamEntry(
                job="leaver",
                kind="embed",
                model="embed-slow",
                submitted_ms=int(time.time() * 1000),
                channel=keys.events("leaver"),
                api_key="alice",
                body=pack(request),
            )
            await r.xadd(keys.jobs("embed-slow"), entry.to_fields())
            await eventually(lambda: served.engine.has_work, 60, "the job's inputs on the engine")
            await publish(r, keys.cancel(), "leaver")  # as the gateway does when its client leaves
            async with asyncio.timeout(30):
                async for message in events.listen():
                    if message["type"] == "message":
                        assert unpack_event(message["data"]).type == "error"
                        break
            await eventually(lambda: r.exists(keys.api_key("alice")), 10, "alice charged")
            record = await r.hgetall(keys.api_key("alice"))
            assert int(record[b"prompt_tokens"]) > 512 and int(record[b"completion_tokens"]) == 0
            today = int(await r.get(keys.daily_tokens("alice", utc_day())))
            assert today == int(record[b"prompt_tokens"])
            assert (await r.xpending(keys.jobs("embed-slow"), "agents"))["pending"] == 0
            await events.aclose()
    finally:
        await r.aclose()
