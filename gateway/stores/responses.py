"""Stored `/v1/responses` responses: one Redis string each (`cortex:response:{id}`, JSON of the
response, the conversation it ends and its request's input items), expiring after `responses_ttl_s`. Every gateway
replica reads them, so `previous_response_id` works whichever replica answers.

A `background` response is held as it was queued (`hold`: the response, and the job's stream
entry under `pending`) and listed in `Keys.background_responses` until it is stored finished
(`put`); gateway/jobs/background.py renders it in between from its job's event log.

Each is its key's (`owner`, the API key's name): every read, delete or continuation names whose it
may see (`Caller.owner`: its own, or for the admin key every one), and another key's is not found
(404), as OpenAI answers across projects."""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.dialects.protocol.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseIncompleteEvent,
    ResponseStreamEvent,
)
from gateway.dialects.render.responses import assistant_turn
from gateway.stores.files import visible
from shared.errors import NotFound, PreviousResponseNotFound
from shared.keys import Keys
from shared.redis_conn import atomic


@dataclass
class Kept:
    """What a stored response keeps besides itself."""

    conversation: list[dict[str, Any]]  # the turns before it (its own is added when it is stored)
    owner: str  # the API key's name (`Caller.name`)
    input: list[dict[str, Any]] = field(default_factory=list)  # its request's input items, as sent

    @classmethod
    def of(cls, spec: dict[str, Any], owner: str) -> "Kept":
        """From a resumable job's spec (gateway/http/routes/responses.py), which names the first two."""
        return cls(spec.get("conversation") or [], owner, spec.get("input") or [])


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int):
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s

    async def put(self, response: Response, kept: Kept) -> None:
        """Keep `response` with what `kept` says, its own turn last in the conversation."""
        value = {
            "response": response.model_dump(mode="json"),
            "owner": kept.owner,
            "input": kept.input,
            "conversation": [*kept.conversation, assistant_turn(response)],
        }
        async with atomic(self.redis) as pipe:
            pipe.set(self.keys.response(response.id), json.dumps(value), ex=self.ttl_s)
            pipe.zrem(self.keys.background_responses(), response.id)
            await pipe.execute()

    async def hold(self, response: Response, stream: str, entry_id: str, owner: str) -> None:
        """Keep `owner`'s background response as it is queued, until it is `put` finished."""
        value = {
            "response": response.model_dump(mode="json"),
            "pending": {"stream": stream, "entry": entry_id},
            "owner": owner,
        }
        async with atomic(self.redis) as pipe:
            pipe.set(self.keys.response(response.id), json.dumps(value), ex=self.ttl_s)
            pipe.zadd(self.keys.background_responses(), {response.id: response.created_at * 1000})
            await pipe.execute()

    async def read(self, response_id: str, owner: str | None) -> dict[str, Any] | None:
        """`{"response", "conversation", "owner"}`, or `{"response", "pending", "owner"}` for a background
        one not yet finished; None when there is none, or it is not `owner`'s (None: anyone's)."""
        raw = await self.redis.get(self.keys.response(response_id))
        stored = json.loads(raw) if raw is not None else None
        return stored if stored is not None and visible(stored.get("owner"), owner) else None

    async def conversation(self, response_id: str, owner: str | None) -> list[dict[str, Any]]:
        if (stored := await self.read(response_id, owner)) is None:
            raise PreviousResponseNotFound(
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
            )
        if "pending" in stored:
            raise PreviousResponseNotFound(
                f"Previous response with id '{response_id}' is still "
                f"{stored['response']['status']}; continue from it once it has finished.",
                param="previous_response_id",
            )
        return stored["conversation"]

    async def input_items(self, response_id: str, owner: str | None) -> list[dict[str, Any]]:
        """The input items of `owner`'s stored response, each with an id (its own, or one named after
        the response); NotFound when there is none (or not yet: a background one still running)."""
        stored = await self.read(response_id, owner)
        if stored is None or "pending" in stored:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        return [
            {"id": f"{response_id}_input_{i}"} | item
            for i, item in enumerate(stored.get("input", []))
        ]

    async def delete(self, response_id: str, owner: str | None) -> None:
        if await self.read(response_id, owner) is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
        async with atomic(self.redis) as pipe:
            pipe.delete(self.keys.response(response_id))
            pipe.zrem(self.keys.background_responses(), response_id)
            deleted, _ = await pipe.execute()
        if not deleted:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")

    async def kept_at_the_end(
        self, events: AsyncIterator[ResponseStreamEvent], kept: Kept
    ) -> AsyncIterator[ResponseStreamEvent]:
        """`events`, storing the final response (with `kept`) before its last event goes out."""
        async for event in events:
            if isinstance(event, ResponseCompletedEvent | ResponseIncompleteEvent):
                await self.put(event.response, kept)
            yield event
