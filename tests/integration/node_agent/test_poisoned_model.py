"""A device error poisons the model: its jobs fail with a 503-class error that says why, the
node keeps running, and the model is reloaded and serves again."""

import asyncio
import time

import redis.asyncio as aioredis
import torch

from node_agent.serving.agent import NodeAgent
from shared.lifecycle import ModelState
from shared.settings import NodeSettings
from shared.wire import GenerationRequest, SamplingParams, StreamEntry, pack, unpack_event
from tests.conftest import eventually


async def ask(r: aioredis.Redis, keys, model: str, job: str) -> list:
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.events(job))
    request = GenerationRequest(
        job=job,
        model=model,
        kind="completion",
        prompt="Hello",
        sampling=SamplingParams(temperature=0, max_tokens=4),
    )
    entry = StreamEntry(
        job=job,
        kind="completion",
        model=model,
        submitted_ms=int(time.time() * 1000),
        channel=keys.events(job),
        body=pack(request),
    )
    await r.xadd(keys.jobs(model), entry.to_fields())
    events = []
    async with asyncio.timeout(60):
        async for message in pubsub.listen():
            if message["type"] == "message":
                events.append(unpack_event(message["data"]))
                if events[-1].type not in ("start", "delta"):
                    break
    await pubsub.aclose()
    return events


async def test_device_error_poisons_then_reloads(redis_url, tiny_dirs, tmp_path):
    folder = tiny_dirs["llama"]
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nid = "tiny"\nsource = "{folder}"\ndtype = "float32"\nslots = 2\nmax_model_len = 128\n'
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
    served = None
    try:
        await eventually(
            lambda: (m := agent.models.get("tiny")) is not None and m.state == ModelState.READY,
            60,
            "tiny ready",
        )
        served = agent.models["tiny"]
        r = aioredis.Redis.from_url(redis_url)
        assert (await ask(r, agent.keys, "tiny", "ok1"))[-1].type == "done"

        forward = served.engine.lm.model.model.forward

        def not_a_device_fault(*args, **kwargs):
            raise ValueError("a bug in this step")

        served.engine.lm.model.model.forward = not_a_device_fault
        events = await ask(r, agent.keys, "tiny", "unlucky")
        assert events[-1].type == "error" and events[-1].code == "generation_failed"
        assert served.state == ModelState.READY  # the model is not reloaded for it
        served.engine.lm.model.model.forward = forward
        assert (await ask(r, agent.keys, "tiny", "ok2"))[-1].type == "done"

        def device_fault(*args, **kwargs):
            raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB")

        served.engine.lm.model.model.forward = device_fault
        events = await ask(r, agent.keys, "tiny", "bad")
        assert events[-1].type == "error" and events[-1].code == "model_poisoned"
        assert "out of memory" in events[-1].message
        await eventually(lambda: served.state == ModelState.READY, 60, "tiny reloaded")
        assert (await ask(r, agent.keys, "tiny", "ok3"))[-1].type == "done"
        assert (await r.xpending(agent.keys.jobs("tiny"), "agents"))["pending"] == 0
        await r.aclose()
    finally:
        agent.stop()
        await asyncio.wait_for(running, 60)
