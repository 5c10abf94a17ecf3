"""Following a pull across the nodes asked to make it, from their heartbeats (`pulls`) and what
they publish as held (`Keys.model_files`): for `cortex models pull` and Ollama's `/api/pull`."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.fleet import Fleet
from shared.heartbeat import PullProgress

POLL_S = 0.5
START_WAIT_S = (
    15.0  # a node showing no pull and not holding the files after this long is not pulling
)


@dataclass(frozen=True)
class NodePull:
    """Where one node is with the files: `ended` once it holds them (`ok`) or cannot (`why`)."""

    progress: PullProgress | None = None
    ended: bool = False
    ok: bool = False
    why: str = ""


async def watch(fleet: Fleet, folder: str, nodes: list[str]) -> AsyncIterator[dict[str, NodePull]]:
    """Each node's state, every `POLL_S`, until every node has ended (the last state included)."""
    states: dict[str, NodePull] = {}
    started = time.monotonic()
    while True:
        beats = {
            name: await fleet.node(name) for name in nodes if not states.get(name, NodePull()).ended
        }
        holders = set(
            await fleet.file_holders(folder, [b for b in beats.values() if b is not None])
        )
        for name, beat in beats.items():
            progress = beat.pulls.get(folder) if beat is not None else None
            if name in holders:
                states[name] = NodePull(progress, ended=True, ok=True)
            elif beat is None:
                states[name] = NodePull(ended=True, why="it is gone (no heartbeat)")
            elif progress is not None:
                states[name] = NodePull(progress, ended=bool(progress.error), why=progress.error)
            elif time.monotonic() - started > START_WAIT_S:
                states[name] = NodePull(
                    ended=True, why="it is not pulling (are its files in its Hugging Face cache?)"
                )
            else:
                states[name] = NodePull()
        yield dict(states)
        if all(state.ended for state in states.values()):
            return
        await asyncio.sleep(POLL_S)
