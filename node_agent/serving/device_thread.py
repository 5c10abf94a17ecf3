"""One OS thread per device. It owns everything on the device (loads, forwards, cache, memory
queries, unloads); the event loop hands it work through a queue and gets results back with
`call_soon_threadsafe`. Only ids, text and numbers cross over, never tensors.

Each engine is attached with its own sinks (its `ServedModel`'s): a step's record goes, from this
thread, straight to the model's output process (node_agent/serving/output_link.py), which turns
it into events; an error that ended a step goes to the model on the event loop. An embedding or
rerank model's `PoolingEngine` is stepped the same way, one forward pass a step; its sink hands
finished jobs to the event loop (node_agent/serving/served_pooler.py)."""

import asyncio
import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from node_agent.engine.engine import Engine
from node_agent.engine.pooler import PoolingEngine, PoolingStep
from node_agent.engine.records import StepOutput
from node_agent.model import devices
from shared.heartbeat import DeviceInfo

log = logging.getLogger(__name__)

Stepped = Engine | PoolingEngine
StepSink = Callable[
    [StepOutput | PoolingStep], None
]  # called on the device thread with one step's record
FailureSink = Callable[
    [BaseException, list[str], bool], None
]  # on the loop: the error, the jobs it failed,
# and whether the device itself is at fault


@dataclass(frozen=True)
class Sinks:
    on_step: StepSink
    on_failure: FailureSink


class DeviceThread:
    def __init__(self, device: str, loop: asyncio.AbstractEventLoop, *, nice: int = 0):
        self.device = device
        self.loop = loop
        self.nice = nice  # nice levels below the thread that starts it (NodeSettings.device_nice)
        self._engines: dict[Stepped, Sinks] = {}  # touched on the device thread only
        self.last_info: DeviceInfo | None = None  # the latest memory reading, taken on this thread
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"device-{device}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """Run `fn(*args)` on the device thread; the returned future resolves on the event loop."""
        future = self.loop.create_future()

        def work() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # handed back to the awaiting coroutine
                self.loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, future, result, None)

        self._inbox.put(work)
        return future

    async def attach(self, engine: Stepped, on_step: StepSink, on_failure: FailureSink) -> None:
        """Step `engine` from now on, its events and failures going to these sinks."""
        await self.call(self._attach, engine, Sinks(on_step, on_failure))

    async def detach(self, engine: Stepped) -> None:
        await self.call(self._detach, engine)

    def _attach(self, engine: Stepped, sinks: Sinks) -> None:
        self._engines[engine] = sinks
        self._note_sharing()

    def _detach(self, engine: Stepped) -> None:
        self._engines.pop(engine, None)
        self._note_sharing()

    def _note_sharing(self) -> None:
        """Tell each engine whether another one shares the device (a pooling engine's passes are
        then bounded in time: node_agent/engine/pooler.py)."""
        for engine in self._engines:
            engine.shares_device = len(self._engines) > 1

    async def info(self) -> DeviceInfo:
        """The latest memory reading. A new one is asked for each time, but only the first call
        waits for it: a heartbeat must not wait behind a long step, a load or a grammar compile."""
        reading = self.call(devices.describe, self.device)
        reading.add_done_callback(self._keep_reading)
        if self.last_info is None:
            await reading
        return self.last_info

    def _keep_reading(self, reading: asyncio.Future) -> None:
        if not reading.cancelled() and reading.exception() is None:
            self.last_info = reading.result()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(lambda: None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        lower_priority(self.nice)
        while not self._stopping:
            busy = [e for e in self._engines if e.has_work]
            try:
                work = self._inbox.get(block=not busy, timeout=None)
            except queue.Empty:
                work = None
            while work is not None:
                work()
                work = self._drain_one()
            for engine in [
                e for e in busy or self._engines if e.has_work
            ]:  # the work just run may have taken it
                self._step(engine, self._engines.get(engine))

    def _drain_one(self) -> Callable[[], None] | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _step(self, engine: Stepped, sinks: Sinks | None) -> None:
        if sinks is not None:  # None: detached by work run just before
            step_engine(engine, sinks, self.device, self.loop)


def lower_priority(levels: int) -> None:
    """Run the calling thread `levels` nice levels below its priority now (at most 19; the threads
    it starts, OpenMP's among them, inherit it). Linux only: elsewhere niceness is the process's."""
    if levels <= 0 or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, now + levels))
    except OSError as exc:  # a sandbox refusing setpriority: the thread keeps its priority
        log.warning("could not lower the device thread's priority by %d: %s", levels, exc)


def step_engine(
    engine: Stepped, sinks: Sinks, device: str, loop: asyncio.AbstractEventLoop
) -> None:
    """One step of `engine`, its record to `sinks.on_step`; an error fails the step's jobs, not the
    caller (a device thread, or a simulated device on the loop: node_agent/sim/device.py), and goes
    to `sinks.on_failure` on the loop, with whether the device itself is at fault."""
    try:
        out = engine.core_step()
    except Exception as exc:  # it fails this step's jobs; a broken device poisons the model
        log.exception("engine step failed on %s", device)
        jobs = engine.fail_all()
        try:
            device_fault = engine.is_device_fault(exc)
        except Exception:  # cannot tell: treat it as the device's (the model is reloaded)
            log.exception("telling whether the failure is the device's failed on %s", device)
            device_fault = True
        loop.call_soon_threadsafe(sinks.on_failure, exc, jobs, device_fault)
        return
    if not out.empty:
        sinks.on_step(out)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
