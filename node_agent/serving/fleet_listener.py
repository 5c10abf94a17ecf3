"""The node's pub/sub listener: cancels from the fleet (`Keys.cancel`: every node hears each, on a
cluster through any master, which passes each PUBLISH to all) and newcomers to the waiting rooms of
the models this node serves (`Keys.newcomers(model)`: only those models' replicas hear them). It
rides out Redis outages, subscribing again to all of them once Redis is back."""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.keys import Keys
from shared.redis_conn import Outage, broadcast_client


class FleetListener:
    def __init__(
        self,
        redis: aioredis.Redis,
        redis_url: str,
        keys: Keys,
        cancel: Callable[[str], Awaitable[None]],
        newcomer: Callable[[str], None],
    ):
        self.redis, self.redis_url, self.keys = redis, redis_url, keys
        self._cancel, self._newcomer = cancel, newcomer
        self._models: set[str] = set()  # whose newcomers are heard
        self._pubsub: aioredis.client.PubSub | None = None

    async def hear(self, models: Iterable[str]) -> None:
        """Hear the newcomers of `models` (the models served here now), and no others."""
        self._models = set(models)
        await self._follow()

    async def _follow(self) -> None:
        """Subscribe to the newcomers' channels of `_models` the connection does not hold yet, and
        leave those of models no longer here. Run after each connect as well as each `hear`: a
        `hear` while the listener was connecting changed `_models` after its SUBSCRIBE was sent."""
        pubsub = self._pubsub
        if pubsub is None:
            return  # (the listener follows them once it is connected)
        names = (c.decode() if isinstance(c, bytes) else c for c in pubsub.channels)
        held = {name for name in names if name.startswith(self.keys.newcomers(""))}
        wanted = {self.keys.newcomers(m) for m in self._models}
        try:
            if wanted - held:
                await pubsub.subscribe(*sorted(wanted - held))
            if held - wanted:
                await pubsub.unsubscribe(*sorted(held - wanted))
        except (RedisError, OSError) as exc:  # the listener's next connection subscribes anew
            logging.getLogger(__name__).warning("newcomers' channels: %s", exc)

    async def run(self) -> None:
        log = logging.getLogger(__name__)
        outage = Outage(log, "fleet listener")
        newcomers = self.keys.newcomers("")
        while True:
            client = None
            try:
                client = await broadcast_client(self.redis, self.redis_url)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.keys.cancel())
                self._pubsub = pubsub
                await self._follow()
                outage.ok()
                async for message in pubsub.listen():
                    channel = message["channel"].decode()
                    if channel.startswith(newcomers):
                        self._newcomer(channel[len(newcomers) :])
                    else:
                        await self._cancel(message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outage.failed(exc)
                await asyncio.sleep(1)
            finally:
                self._pubsub = None
                if client is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await client.aclose()
