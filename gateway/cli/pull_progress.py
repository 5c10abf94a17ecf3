"""`cortex models pull` follows the pull on each node it asked, from their heartbeats (`pulls`) and
what they publish as held (`Keys.model_files`), printing a line whenever a node's progress moves,
until every node holds the files or failed. Ctrl-C stops following; the nodes pull on."""

import asyncio
import time

from shared.fleet import Fleet
from shared.heartbeat import PullProgress

POLL_S = 0.5
START_WAIT_S = 15.0  # a node showing no pull and not holding the files after this long is not pulling


def describe(progress: PullProgress) -> str:
    if progress.error:
        return f"failed: {progress.error}"
    if not progress.bytes_total:
        return progress.source or "starting"
    return (f"{100 * progress.bytes_done // progress.bytes_total}% of {progress.bytes_total / 1e6:.1f} MB"
            f" at {progress.rate_bps / 1e6:.1f} MB/s from {progress.source}")


async def follow(fleet: Fleet, folder: str, nodes: list[str], say=print) -> bool:
    """Until each of `nodes` holds `folder` or failed; True when all hold it."""
    shown: dict[str, str] = {}
    ended: dict[str, bool] = {}
    started = time.monotonic()
    while len(ended) < len(nodes):
        beats = {name: await fleet.node(name) for name in nodes if name not in ended}
        holders = set(await fleet.file_holders(folder, [b for b in beats.values() if b is not None]))
        for name, beat in beats.items():
            progress = beat.pulls.get(folder) if beat is not None else None
            if name in holders:
                line, ended[name] = "has the files", True
            elif beat is None:
                line, ended[name] = "is gone (no heartbeat)", False
            elif progress is not None:
                line = describe(progress)
                if progress.error:
                    ended[name] = False
            elif time.monotonic() - started > START_WAIT_S:
                line, ended[name] = "is not pulling (are its files in its Hugging Face cache?)", False
            else:
                line = "starting"
            if shown.get(name) != line:
                say(f"{name}: {line}")
                shown[name] = line
        await asyncio.sleep(POLL_S if len(ended) < len(nodes) else 0)
    return all(ended.values())
