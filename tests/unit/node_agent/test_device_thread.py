"""The device thread tells its engines whether another model's engine shares the device (a pooling
engine then bounds its passes in time: test_pooler.py), and runs below the agent's priority
(`device_nice`), so that its steps yield the CPU to the node's I/O and the host's control plane."""

import asyncio
import os
import sys
import threading

import pytest

from node_agent.engine.on_device import OnDevice
from node_agent.serving.device_thread import DeviceThread


class Idle(OnDevice):
    has_work = False


async def test_engines_know_whether_another_shares_their_device():
    device = DeviceThread("cpu", asyncio.get_running_loop())
    device.start()
    try:
        chat, embedder = Idle(), Idle()
        sinks = (lambda out: None, lambda exc, jobs, fault: None)
        await device.attach(chat, *sinks)
        assert not chat.shares_device
        await device.attach(embedder, *sinks)
        assert chat.shares_device and embedder.shares_device
        await device.detach(chat)
        assert not embedder.shares_device
    finally:
        device.stop()


def _own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux")
@pytest.mark.parametrize("nice", [0, 7])
async def test_the_device_thread_runs_its_nice_levels_below_the_agent(nice):
    before = _own_niceness()
    device = DeviceThread("cpu", asyncio.get_running_loop(), nice=nice)
    device.start()
    try:
        assert await device.call(_own_niceness) == min(19, _own_niceness() + nice)
        started = await device.call(lambda: _in_a_new_thread(_own_niceness))
        assert started == min(19, _own_niceness() + nice)  # what it starts (OpenMP's pool) too
    finally:
        device.stop()
    assert _own_niceness() == before  # the loop's thread (the process's first) keeps its own


def _in_a_new_thread(fn):
    found = []
    thread = threading.Thread(target=lambda: found.append(fn()))
    thread.start()
    thread.join()
    return found[0]
