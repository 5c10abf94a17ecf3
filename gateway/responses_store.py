"""Stored `/v1/responses` responses: one Redis string each (`cortex:response:{id}`, JSON of the
response and the conversation it ends), expiring after `responses_ttl_s`. Every gateway
replica reads them, so `previous_response_id` works whichever replica answers."""

import json
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from gateway.protocol.responses import Response, ResponseCompletedEvent, ResponseIncompleteEvent, ResponseStreamEvent
from gateway.render.responses import assistant_turn
from shared.errors import NotFound, PreviousResponseNotFound
from shared.keys import Keys


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int):
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s

    async def put(self, response: Response, conversation: list[dict[str, Any]]) -> None:
        """Keep `response`, with the conversation so far and its own turn last."""
        value = {"response": response.model_dump(mode="json"), "conversation": [*conversation, assistant_turn(response)]}
        await self.redis.set(self.keys.response(response.id), json.dumps(value), ex=self.ttl_s)

    async def _read(self, response_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.keys.response(response_id))
        return json.loads(raw) if raw is not None else None

    async def get(self, response_id: str) -> dict[str, Any]:
        if (stored := await self._read(response_id)) is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return stored["response"]

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        if (stored := await self._read(response_id)) is None:
            raise PreviousResponseNotFound(f"Previous response with id '{response_id}' not found.",
                                           param="previous_response_id")
        return stored["conversation"]

    async def delete(self, response_id: str) -> None:
        if not await self.redis.delete(self.keys.response(response_id)):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")

    async def kept_at_the_end(self, events: AsyncIterator[ResponseStreamEvent],
                              conversation: list[dict[str, Any]]) -> AsyncIterator[ResponseStreamEvent]:
        """`events`, storing the final response before its last event goes out."""
        async for event in events:
            if isinstance(event, ResponseCompletedEvent | ResponseIncompleteEvent):
                await self.put(event.response, conversation)
            yield event
