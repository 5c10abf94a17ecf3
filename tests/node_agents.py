"""A real node agent in the test's own event loop, serving one model of a catalogue written for it:
for tests that drive its streams and pub/sub by hand (tests/integration/node_agent/)."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from node_agent.serving.agent import NodeAgent
from shared.lifecycle import ModelState
from shared.settings import NodeSettings
from tests.conftest import eventually


@asynccontextmanager
async def agent_serving(
    redis_url: str, folder: Path, models_toml: str, model: str, node: str = "n1"
) -> AsyncIterator[NodeAgent]:
    """The agent once `model` is ready; stopped (and its run awaited) on the way out."""
    (folder / "models.toml").write_text(models_toml)
    settings = NodeSettings(
        redis_url=redis_url,
        models=[model],
        node_name=node,
        models_file=folder / "models.toml",
        convert_cache=None,
    )
    agent = NodeAgent(settings)
    running = asyncio.create_task(agent.run())
    try:
        await eventually(
            lambda: (m := agent.models.get(model)) is not None and m.state == ModelState.READY,
            60,
            f"{model} ready",
        )
        yield agent
    finally:
        agent.stop()
        await asyncio.wait_for(running, 60)
