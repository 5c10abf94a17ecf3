"""The janitor's loop (gateway/fleet/janitor.py): stopped in the middle of a sweep whose lock has
expired meanwhile (a sweep longer than the lock's timeout, as at 1,000 nodes), it stops; the
lock's release failing must not turn the cancel into one more round."""

import asyncio

from gateway.fleet.janitor import Janitor
from tests.unit.gateway.conftest import KEYS


async def test_a_janitor_stopped_mid_sweep_stops_though_its_lock_expired(app, redis, monkeypatch):
    ctx = app.state.ctx
    monkeypatch.setattr(ctx.settings, "janitor_interval_s", 0.01)
    sweeping = asyncio.Event()

    async def long_sweep() -> None:
        sweeping.set()
        await redis.delete(KEYS.janitor_lock())  # expired: the release will find it gone
        await asyncio.sleep(3600)

    janitor = Janitor(ctx.placer)
    monkeypatch.setattr(janitor, "sweep", long_sweep)
    janitor.start()
    await asyncio.wait_for(sweeping.wait(), 5)
    await asyncio.wait_for(janitor.stop(), 5)
    assert janitor._task.done()
