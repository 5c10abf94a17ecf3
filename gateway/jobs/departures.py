"""A streamed job whose client went away runs on for `disconnect_grace_s`, so that the client can
resume it (through any replica); then, unless someone reads it again, it is cancelled.

"Someone reads it" is whoever listens on the job's channel: the request that submitted it, and
clients resuming it, on any replica (`PUBSUB NUMSUB`). A client that resumes and goes away again
within the grace starts a grace of its own: each departure writes its token to `Keys.detached`,
and only the last one's timer may cancel. The timers live in the gateway that saw the client go;
if that gateway dies too, the job runs to its end (its client may still resume it until then).
"""

import asyncio
import logging
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.keys import Keys
from shared.redis_conn import publish
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

TOKEN_SLACK_S = 60  # the departure's token outlives its grace by this much


class Departures:
    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: GatewaySettings):
        self.redis, self.keys, self.settings = redis, keys, settings
        self._timers: set[asyncio.Task] = set()

    async def left(self, job: str) -> None:
        """The last client of `job` here stopped reading it: cancel it after the grace unless
        someone reads it by then."""
        grace_s = self.settings.disconnect_grace_s
        token = uuid.uuid4().hex
        try:
            await self.redis.set(
                self.keys.detached(job), token, px=int((grace_s + TOKEN_SLACK_S) * 1000)
            )
        except RedisError as exc:  # the job runs to its end; nothing else is lost
            log.warning("job=%s: could not note its client's departure: %s", job, exc)
            return
        timer = asyncio.create_task(self._cancel_later(job, token, grace_s), name=f"grace-{job}")
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _cancel_later(self, job: str, token: str, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        keys, redis = self.keys, self.redis
        try:
            if (await redis.get(keys.detached(job))) != token.encode():
                return  # a client resumed it and went away after us: its own timer decides
            [(_, readers)] = await redis.pubsub_numsub(keys.events(job))
            if readers:
                return  # a client resumed it and reads it now
            await publish(redis, keys.cancel(), job)
            await redis.delete(keys.detached(job))
            log.info("job=%s cancelled: no client read it for %gs", job, grace_s)
        except RedisError as exc:
            log.warning("job=%s: could not cancel it after its grace: %s", job, exc)

    async def stop(self) -> None:
        """The gateway stops: the jobs still in their grace run to their end."""
        for timer in list(self._timers):
            timer.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
