"""The node agent: device threads, the models they serve, the heartbeat, cancel handling and a
clean shutdown on SIGTERM/SIGINT."""

import asyncio
import logging
import os
import signal
import socket
import time

import torch

from node_agent import devices
from node_agent.device_thread import DeviceThread
from node_agent.engine import Engine
from node_agent.publisher import Publisher
from node_agent.served_model import ServedModel
from shared import __version__
from shared.catalog import Catalog
from shared.heartbeat import NodeHeartbeat
from shared.redis_conn import connect
from shared.settings import NodeSettings

log = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


class NodeAgent:
    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.keys = settings.keys
        self.name = settings.node_name or f"{socket.gethostname()}-{os.getpid()}"
        self.catalog = Catalog.load(settings.models_file)
        self.started_ms = _now_ms()
        self.state = "active"
        self.models: dict[str, ServedModel] = {}
        self.threads: dict[str, DeviceThread] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        self.redis = connect(self.settings.redis_url)
        self.publisher = Publisher(self.redis, self.keys, on_unheard=self._on_unheard)
        self.publisher.start()
        for device in devices.discover(self.settings.device):
            thread = DeviceThread(device, loop, self._on_step, self._on_failure)
            thread.start()
            self.threads[device] = thread
        first_device = next(iter(self.threads.values()))
        for model_id in self.settings.models:
            profile = self.catalog.resolve(model_id)
            self.models[profile.id] = ServedModel(profile, first_device, self.redis, self.keys, self.publisher,
                                                  self.name, self.settings)
        tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._cancel_listener())]
        await asyncio.gather(*(m.load() for m in self.models.values()))
        await self._stop.wait()
        log.info("node %s stopping", self.name)
        await self.shutdown(tasks)

    def stop(self) -> None:
        """Ask `run()` to shut down cleanly (what SIGTERM does)."""
        self._stop.set()

    async def shutdown(self, tasks: list[asyncio.Task]) -> None:
        self.state = "draining"
        await self._beat()
        await asyncio.gather(*(m.drain(self.settings.shutdown_grace_s) for m in self.models.values()))
        await self.publisher.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.redis.delete(self.keys.node(self.name))
        await self.redis.zrem(self.keys.nodes(), self.name)
        for thread in self.threads.values():
            thread.stop()
        await self.redis.aclose()
        log.info("node %s stopped", self.name)

    # ---- heartbeat ---------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception as exc:  # Redis away: keep serving, keep trying
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _beat(self) -> None:
        now = _now_ms()
        beat = NodeHeartbeat(
            node=self.name, version=__version__, state=self.state, started_ms=self.started_ms, heartbeat_ms=now,
            devices=[await t.refresh_info() for t in self.threads.values()],
            models={mid: m.info() for mid, m in self.models.items()},
        )
        key = self.keys.node(self.name)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=beat.to_hash())
        pipe.pexpire(key, int(self.settings.heartbeat_ttl_s * 1000))
        pipe.zadd(self.keys.nodes(), {self.name: now})
        await pipe.execute()

    # ---- events from device threads and the fleet -------------------------------------------------

    def _model_of(self, engine: Engine) -> ServedModel | None:
        return next((m for m in self.models.values() if m.engine is engine), None)

    def _on_step(self, engine: Engine, events: list[tuple[str, list]]) -> None:
        model = self._model_of(engine)
        if model is not None:
            model.on_step(events)

    def _on_failure(self, engine: Engine, exc: BaseException, jobs: list[str]) -> None:
        model = self._model_of(engine)
        if model is not None:
            model.poison(exc, jobs)

    def _on_unheard(self, job: str) -> None:
        log.info("job %s has no listener any more; cancelling it", job)
        asyncio.get_running_loop().create_task(self._cancel(job))

    async def _cancel(self, job: str) -> None:
        for model in self.models.values():
            await model.cancel(job)

    async def _cancel_listener(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.keys.cancel())
                async for message in pubsub.listen():
                    await self._cancel(message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cancel listener: %s; reconnecting", exc)
                await asyncio.sleep(1)


def run(settings: NodeSettings | None = None) -> None:
    settings = settings or NodeSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    asyncio.run(NodeAgent(settings).run())
