"""A simulated replica's output side, in the node's own process: the same `OutputSide` (text side,
publisher, prefix marks index) a model's output process runs (node_agent/serving/output_process.py),
behind `OutputLink`'s interface (node_agent/serving/output_link.py), on the node's Redis client.
Feedback is handed to the node on the loop's next turn, as a process's would arrive; a failure of
the side ends the link as a process's exit would (the replica is poisoned and reloaded)."""

import asyncio
import logging
from typing import Callable

import redis.asyncio as aioredis

from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.records import StepOutput
from node_agent.serving.output_messages import Delivery, Feedback, Open, Outgoing, Publish, Step
from node_agent.serving.output_process import OutputSide, open_side

log = logging.getLogger(__name__)


class LocalLink:
    def __init__(
        self,
        config: dict,
        on_feedback: Callable[[Feedback], None],
        on_exit: Callable[[str], None],
        redis: aioredis.Redis,
    ):
        self.config, self.on_feedback, self.on_exit, self.redis = (
            config,
            on_feedback,
            on_exit,
            redis,
        )
        self.side: OutputSide | None = None
        self.alive = False

    async def start(self) -> None:
        """Nothing to start: the side opens with the engine's tokenizer (`open`)."""

    def open(self, text: TokenizerText) -> None:
        loop = asyncio.get_running_loop()
        opened = Open(**self.config, tokenizer=b"")
        self.side = open_side(
            opened, text, self.redis, lambda f: loop.call_soon(self.on_feedback, f)
        )
        self.alive = True

    def step(self, out: StepOutput) -> None:
        self._handle(Step(out))

    def publish(self, items: list[Outgoing], routes: list[Delivery] = ()) -> None:
        self._handle(Publish(items, list(routes)))

    def _handle(self, message: Step | Publish) -> None:
        if not self.alive:
            return
        try:
            self.side.handle(message)
        except Exception as exc:
            log.exception("%s: the output side failed", self.config["model"])
            self.alive = False
            self.on_exit(f"the output side of {self.config['model']} failed ({exc})")

    async def close(self) -> None:
        """Publish what the side holds."""
        self.alive = False
        if self.side is not None:
            await self.side.publisher.stop()
