"""A simulated device: `DeviceThread`'s interface (node_agent/serving/device_thread.py) on the event
loop, so a thousand nodes share one process. Work handed to it runs at once (a coroutine, such as
a load that takes `load_s`, is awaited); the attached engines with work are stepped together through
the same `step_engine` a device thread uses, their records handed on `step_ms` later; a detach
takes `unload_s`. It calls itself
`cpu`, so the node reports its memory as its budget (`memory_budget_mb`) less its models'."""

import asyncio
import inspect
from typing import Any, Callable

from node_agent.engine.engine import Engine
from node_agent.serving.device_thread import FailureSink, Sinks, StepSink, step_engine
from node_agent.sim.config import SimConfig
from node_agent.sim.runner import sim_engine
from shared.catalog import ModelProfile
from shared.heartbeat import DeviceInfo


class SimDevice:
    device = "cpu"

    def __init__(self, config: SimConfig, loop: asyncio.AbstractEventLoop):
        self.config, self.loop = config, loop
        self._engines: dict[Engine, Sinks] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.last_info = DeviceInfo(
            id=self.device, name="simulated", total_mb=config.memory_mb, free_mb=config.memory_mb
        )

    def start(self) -> None:
        self._task = self.loop.create_task(self._run(), name="sim-device")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def call(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """Run `fn(*args)` now; its result (awaited, if a coroutine) in the returned future."""
        future = self.loop.create_future()
        try:
            result = fn(*args)
        except Exception as exc:
            future.set_exception(exc)
            return future
        finally:
            self._wake.set()  # an engine may have work now
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        future.set_result(result)
        return future

    async def attach(self, engine: Engine, on_step: StepSink, on_failure: FailureSink) -> None:
        self._engines[engine] = Sinks(on_step, on_failure)
        self._wake.set()

    async def detach(self, engine: Engine) -> None:
        self._engines.pop(engine, None)
        await asyncio.sleep(self.config.unload_s)

    async def info(self) -> DeviceInfo:
        return self.last_info

    async def open_engine(self, profile: ModelProfile, node: str) -> Engine:
        """A replica's load: `load_s`, then its engine."""
        await asyncio.sleep(self.config.load_s)
        return sim_engine(profile, self.config, node)

    async def _run(self) -> None:
        """Step every engine with work at once, then hand out their records when the step's time
        is up (a device's step starts when work is there and ends `step_ms` later)."""
        while True:
            busy = [e for e in self._engines if e.has_work]
            if not busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            began, done = self.loop.time(), []
            for engine in busy:
                if (sinks := self._engines.get(engine)) is not None:
                    held = Sinks(
                        lambda out, sinks=sinks: done.append((sinks, out)), sinks.on_failure
                    )
                    step_engine(engine, held, self.device, self.loop)
            await asyncio.sleep(max(0.0, self.config.step_s - (self.loop.time() - began)))
            for sinks, out in done:
                sinks.on_step(out)
