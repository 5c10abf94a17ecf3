"""A model's output process (node_agent/serving/output_process.py) that dies is noticed: the jobs in
flight fail with a 503-class error that says why, and the model is reloaded with a new output
process that serves the next jobs."""

import asyncio
import os
import signal
import time

import redis.asyncio as aioredis

from node_agent.serving.agent import NodeAgent
from shared.lifecycle import ModelState
from shared.settings import NodeSettings
from shared.wire import GenerationRequest, SamplingParams, StreamEntry, pack, unpack_event
from tests.conftest import eventually


async def submit(r: aioredis.Redis, keys, job: str, max_tokens: int):
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.events(job))
    request = GenerationRequest(
        job=job,
        model="tiny",
        kind="completion",
        prompt="Hello",
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    entry = StreamEntry(
        job=job,
        kind="completion",
        model="tiny",
        submitted_ms=int(time.time() * 1000),
        channel=keys.events(job),
        body=pack(request),
        stream=True,
    )
    await r.xadd(keys.jobs("tiny"), entry.to_fields())
    return pubsub


async def events_of(pubsub, until=lambda events: events[-1].type not in ("start", "delta")) -> list:
    events = []
    async with asyncio.timeout(60):
        async for message in pubsub.listen():
            if message["type"] == "message":
                events.append(unpack_event(message["data"]))
                if until(events):
                    return events


async def test_a_dead_output_process_fails_jobs_in_flight_and_the_model_comes_back(
    redis_url, tiny_dirs, tmp_path
):
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nid = "tiny"\nsource = "{tiny_dirs["llama"]}"\ndtype = "float32"\nslots = 1\n'
        "max_model_len = 512\n"
    )
    settings = NodeSettings(
        redis_url=redis_url,
        models=["tiny"],
        node_name="n1",
        models_file=tmp_path / "models.toml",
        convert_cache=None,
    )
    agent = NodeAgent(settings)
    running = asyncio.create_task(agent.run())
    r = aioredis.Redis.from_url(redis_url)
    try:
        await eventually(
            lambda: (m := agent.models.get("tiny")) is not None and m.state == ModelState.READY,
            60,
            "tiny ready",
        )
        served = agent.models["tiny"]
        first = served.output.link.process
        assert not any(
            redis_url in str(arg) for arg in first.args
        )  # `ps` shows it: no Redis URL (password) there
        in_flight = await submit(r, agent.keys, "in-flight", 480)
        started = await events_of(in_flight, lambda events: events[-1].type == "delta")
        os.kill(first.pid, signal.SIGKILL)

        events = started + await events_of(in_flight)
        assert events[-1].type == "error" and events[-1].code == "model_poisoned", events[-1]
        assert "output process" in events[-1].message and "-9" in events[-1].message
        await eventually(
            lambda: (
                served.state == ModelState.READY
                and served.output.link is not None
                and served.output.link.process is not first
            ),
            60,
            "tiny back with a new output process",
        )
        later = await events_of(
            await submit(r, agent.keys, "later", 8)
        )  # served by the new output process
        assert [e.type for e in later][-1] == "done" and later[-1].usage.completion_tokens == 8
        assert first.returncode == -signal.SIGKILL  # reaped, not left a zombie
        assert (await r.xpending(agent.keys.jobs("tiny"), "agents"))["pending"] == 0
        assert await r.scard(agent.keys.started("n1")) == 0
        await in_flight.aclose()
    finally:
        await r.aclose()
        agent.stop()
        await asyncio.wait_for(running, 60)
    assert served.output.link is None and first.poll() is not None  # shut down with the node
