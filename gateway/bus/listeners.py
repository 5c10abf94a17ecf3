"""Who listens here to which job's events (gateway/bus/router.py): per job's channel, the queue of each
listener (the request that submitted it, clients resuming it: gateway/jobs/resume.py), the link its
channel is subscribed on (gateway/bus/links.py) and whether an event came on it yet. A job
forgotten here is forgotten by the parking rules too (gateway/bus/queued_jobs.py)."""

import asyncio
from collections.abc import Callable

from gateway.bus.links import Link
from shared.errors import CortexError
from shared.wire import Event

Item = Event | CortexError  # what a job's queue holds


class Listeners:
    def __init__(self, on_forget: Callable[[bytes], None]):
        self._on_forget = on_forget
        self._queues: dict[
            bytes, list[asyncio.Queue[Item]]
        ] = {}  # channel -> its listeners' queues
        self._link_of: dict[bytes, Link] = {}  # channel -> the link it was subscribed on
        self._heard: set[bytes] = set()  # channels an event came on

    def __len__(self) -> int:
        """Jobs with a listener here."""
        return len(self._queues)

    def __contains__(self, key: bytes) -> bool:
        return key in self._queues

    def add(self, key: bytes, queue: asyncio.Queue[Item], link: Link) -> bool:
        """Route `key`'s events to `queue` too; True for the job's first listener here (its channel
        is then on `link`, and wants subscribing)."""
        listeners = self._queues.setdefault(key, [])
        listeners.append(queue)
        if len(listeners) == 1:
            self._link_of[key] = link
        return len(listeners) == 1

    def remove(self, key: bytes, queue: asyncio.Queue[Item]) -> bool:
        """Stop routing `key`'s events to `queue`; True when nobody listens to it here now (it is
        forgotten: its channel wants unsubscribing)."""
        listeners = self._queues.get(key, [])
        if queue in listeners:
            listeners.remove(queue)
        if listeners:
            return False
        self.forget(key)
        return True

    def hear(self, key: bytes, item: Item) -> None:
        """An event came on `key`'s channel."""
        self._heard.add(key)
        self.tell(key, item)

    def tell(self, key: bytes, item: Item) -> None:
        for queue in self._queues.get(key, []):
            queue.put_nowait(item)

    def waiting(self, key: bytes) -> bool:
        """Someone listens to the job here and no event came yet."""
        return key in self._queues and key not in self._heard

    def link_of(self, key: bytes) -> Link | None:
        return self._link_of.get(key)

    def on(self, link: Link) -> list[bytes]:
        """The jobs whose channels are subscribed on `link`."""
        return [key for key, on in self._link_of.items() if on is link]

    def forget(self, key: bytes) -> None:
        self._queues.pop(key, None)
        self._heard.discard(key)
        self._link_of.pop(key, None)
        self._on_forget(key)
