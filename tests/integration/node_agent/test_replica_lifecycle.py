"""A replica's states (node_agent/serving/replica.py): every transition's failure, driven through a
real node agent on a real redis-server with a tiny model. A failed load fails only the jobs routed
to its node alone; nothing stays `loading` or `poisoned` for ever; a second load never starts beside
the first; a failed replica is forgotten after its back-off."""

import asyncio
import contextlib
import threading
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from node_agent.serving import served_model
from node_agent.serving.agent import NodeAgent
from node_agent.serving.job_reader import JobReader
from node_agent.serving.replica import TRANSITIONS, IllegalTransition, Replica
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.settings import NodeSettings
from shared.wire import GenerationRequest, SamplingParams, StreamEntry, pack, unpack_event
from tests.conftest import eventually

pytestmark = pytest.mark.integration


def test_only_the_table_s_transitions_are_allowed():
    for start in ModelState:
        for end in ModelState:
            replica = Replica("m")
            replica.state = start
            if end in TRANSITIONS[start]:
                replica.to(end, "why")
                assert replica.state == end
            else:
                with pytest.raises(IllegalTransition):
                    replica.to(end)


def catalogue(tmp_path, name: str, source) -> dict:
    (tmp_path / f"{name}.toml").write_text(
        f'[[models]]\nid = "tiny"\nsource = "{source}"\ndtype = "float32"\n'
        "slots = 2\nmax_model_len = 128\n"
    )
    return dict(
        models=["tiny"], node_name=name, models_file=tmp_path / f"{name}.toml", convert_cache=None
    )


@contextlib.asynccontextmanager
async def running_agent(redis_url, **settings):
    agent = NodeAgent(NodeSettings(redis_url=redis_url, **settings))
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stop()
        await asyncio.wait_for(task, 60)


async def enqueue(r: aioredis.Redis, stream: str, reply: str, job: str) -> None:
    request = GenerationRequest(
        job=job,
        model="tiny",
        kind="completion",
        prompt="Hello",
        sampling=SamplingParams(temperature=0, max_tokens=3),
    )
    entry = StreamEntry(
        job=job,
        kind="completion",
        model="tiny",
        submitted_ms=int(time.time() * 1000),
        channel=reply,
        body=pack(request),
    )
    await r.xadd(stream, entry.to_fields())


async def subscribed(r: aioredis.Redis, keys, jobs: list[str]):
    pubsub = r.pubsub()
    await pubsub.subscribe(*(keys.events(j) for j in jobs))
    return pubsub


async def last_events(pubsub, count: int, timeout_s: float = 60) -> dict[str, object]:
    """Each of `count` jobs' ending event (done or error), as its client would hear it."""
    ended: dict[str, object] = {}
    async with asyncio.timeout(timeout_s):
        async for message in pubsub.listen():
            if message["type"] == "message":
                event = unpack_event(message["data"])
                if event.type in ("done", "error"):
                    ended[message["channel"].decode().rsplit(":", 1)[-1]] = event
                    if len(ended) == count:
                        break
    await pubsub.aclose()
    return ended


async def test_a_failed_load_fails_only_the_jobs_routed_to_its_node(redis_url, tiny_dirs, tmp_path):
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys()
    jobs = {
        "own": keys.node_jobs("tiny", "bad"),
        "shared-1": keys.jobs("tiny"),
        "shared-2": keys.jobs("tiny"),
    }
    pubsub = await subscribed(r, keys, list(jobs))
    for job, stream in jobs.items():
        await enqueue(r, stream, keys.events(job), job)
    async with running_agent(
        redis_url, **catalogue(tmp_path, "bad", tmp_path / "no-such-model")
    ) as bad:
        await eventually(
            lambda: (m := bad.models.get("tiny")) is not None and m.state == ModelState.FAILED, 60
        )
        assert bad.models["tiny"].replica.error
        async with asyncio.timeout(10):
            while (
                message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            ) is None:
                pass
        event = unpack_event(message["data"])
        assert (
            message["channel"] == keys.events("own").encode() and event.code == "model_load_failed"
        )
        assert await r.xlen(keys.jobs("tiny")) == 2  # the fleet's queue is left for other replicas
        async with running_agent(redis_url, **catalogue(tmp_path, "good", tiny_dirs["llama"])):
            ended = await last_events(pubsub, 2)
        assert {job: e.type for job, e in ended.items()} == {"shared-1": "done", "shared-2": "done"}
    await r.aclose()


async def test_groups_that_cannot_be_made_fail_the_load_and_free_the_engine(
    redis_url, tiny_dirs, tmp_path, monkeypatch
):
    async def redis_away(self):
        raise RedisConnectionError("Redis is restarting")

    monkeypatch.setattr(JobReader, "ensure_groups", redis_away)
    async with running_agent(redis_url, **catalogue(tmp_path, "n1", tiny_dirs["llama"])) as agent:
        await eventually(
            lambda: (m := agent.models.get("tiny")) is not None and m.state == ModelState.FAILED, 60
        )
        served = agent.models["tiny"]
        assert "Redis is restarting" in served.replica.error
        await eventually(lambda: served.engine is None and served.output.link is None, 60)


def blocking_start(monkeypatch) -> tuple[threading.Event, list[int]]:
    """Loads wait on the returned event (on the device thread); the list counts the loads started."""
    release, started = threading.Event(), []
    real = served_model.ServedModel.engine_start

    def slow_start(*args):
        started.append(1)
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(served_model.ServedModel, "engine_start", staticmethod(slow_start))
    return release, started


async def test_a_fault_while_loading_starts_no_second_load(
    redis_url, tiny_dirs, tmp_path, monkeypatch
):
    release, started = blocking_start(monkeypatch)
    async with running_agent(redis_url, **catalogue(tmp_path, "n1", tiny_dirs["llama"])) as agent:
        await eventually(lambda: started, 60)
        served = agent.models["tiny"]
        served.output.on_exit("the output process of tiny exited (code -9)")
        assert served.state == ModelState.LOADING
        release.set()
        await eventually(lambda: served.state == ModelState.READY, 60)
        assert len(started) == 1


async def test_a_load_past_its_bound_is_given_up_and_what_it_built_is_freed(
    redis_url, tiny_dirs, tmp_path, monkeypatch
):
    release, started = blocking_start(monkeypatch)
    async with running_agent(
        redis_url,
        replica_stuck_s=0.5,
        failed_backoff_s=3600,
        **catalogue(tmp_path, "n1", tiny_dirs["llama"]),
    ) as agent:
        await eventually(lambda: started, 60)
        served = agent.models["tiny"]
        await eventually(lambda: served.state == ModelState.FAILED, 60)
        heartbeat = await agent.redis.hget(agent.keys.node("n1"), "models")
        assert b"failed" in heartbeat  # the fleet sees it: nothing counts it as serving
        release.set()
        await eventually(lambda: served.engine is None and served.output.link is None, 60)
        assert served.state == ModelState.FAILED


async def test_a_poisoned_replica_that_cannot_be_freed_fails_and_is_forgotten_after_its_back_off(
    redis_url, tiny_dirs, tmp_path, monkeypatch
):
    async with running_agent(
        redis_url, failed_backoff_s=1.0, **catalogue(tmp_path, "n1", tiny_dirs["llama"])
    ) as agent:
        await eventually(
            lambda: (m := agent.models.get("tiny")) is not None and m.state == ModelState.READY, 60
        )
        served = agent.models["tiny"]

        def sticky_fault():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(served.engine, "free", sticky_fault)
        served.faults.poison(
            RuntimeError("CUDA error: an illegal memory access was encountered"), []
        )
        await eventually(lambda: served.state == ModelState.FAILED, 60)
        assert "freeing it failed" in served.replica.error
        await eventually(
            lambda: "tiny" not in agent.models, 10
        )  # then placement may try it here again


async def test_feedback_that_cannot_be_handled_fails_its_jobs_and_the_model_comes_back(
    redis_url, tiny_dirs, tmp_path
):
    """A bug handling the output process's feedback (which frees slots) must not leave slots taken
    for ever: the link ends as if the process died, the model is reloaded, and serves again."""
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys()
    async with running_agent(redis_url, **catalogue(tmp_path, "n1", tiny_dirs["llama"])) as agent:
        await eventually(
            lambda: (m := agent.models.get("tiny")) is not None and m.state == ModelState.READY, 60
        )
        served = agent.models["tiny"]

        def broken(feedback):
            raise KeyError("a bug")

        served.output.link.on_feedback = broken
        pubsub = await subscribed(r, keys, ["first"])
        await enqueue(r, keys.jobs("tiny"), keys.events("first"), "first")
        await last_events(pubsub, 1)
        await eventually(lambda: served.state == ModelState.POISONED, 60)
        assert "handling its feedback failed (KeyError" in served.replica.error
        await eventually(lambda: served.state == ModelState.READY, 60)
        assert served.ledger.used_slots == 0
        pubsub = await subscribed(r, keys, ["second"])
        await enqueue(r, keys.jobs("tiny"), keys.events("second"), "second")
        assert (await last_events(pubsub, 1))["second"].type == "done"
    await r.aclose()
