"""The device thread tells its engines whether another model's engine shares the device (a pooling
engine then bounds its passes in time: test_pooler.py)."""

import asyncio

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
