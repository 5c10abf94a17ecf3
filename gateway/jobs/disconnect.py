"""Stop work whose client has gone. Streaming responses notice by themselves (see
`streaming.JobStreamResponse`); a non-streaming request runs its work under `unless_disconnected`."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from shared.errors import CortexError

T = TypeVar("T")


class ClientDisconnected(CortexError):
    """nginx's 499: nobody reads the answer any more."""

    status, code, type = 499, "client_disconnected", "invalid_request_error"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected("the client closed the connection before the answer was ready")
