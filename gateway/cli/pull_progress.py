"""`cortex models pull` prints a line whenever a node's progress moves, until every node holds the
files or failed (gateway/fleet/pulls.py). Ctrl-C stops following; the nodes pull on."""

from gateway.fleet.pulls import NodePull, watch
from shared.fleet import Fleet


def describe(state: NodePull) -> str:
    if state.ok:
        return "has the files"
    if state.why:
        return f"failed: {state.why}" if state.progress is not None else state.why
    progress = state.progress
    if progress is None or not progress.bytes_total:
        return progress.source if progress is not None and progress.source else "starting"
    return (
        f"{100 * progress.bytes_done // progress.bytes_total}% of {progress.bytes_total / 1e6:.1f} MB"
        f" at {progress.rate_bps / 1e6:.1f} MB/s from {progress.source}"
    )


async def follow(fleet: Fleet, folder: str, nodes: list[str], say=print) -> bool:
    """Until each of `nodes` holds `folder` or failed; True when all hold it."""
    shown: dict[str, str] = {}
    states: dict[str, NodePull] = {}
    async for states in watch(fleet, folder, nodes):
        for name, state in states.items():
            if shown.get(name) != (line := describe(state)):
                say(f"{name}: {line}")
                shown[name] = line
    return all(state.ok for state in states.values())
