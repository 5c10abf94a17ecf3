"""A replica's way out to Redis: its output process (through its `OutputLink`) while that runs,
so that what the node sends about a job (its start, a failure, a cancel) follows the events the
process holds for it; else the node's publisher (a replica that failed to load, or whose output
process died). The process is started while the model loads and given the tokenizer once the
engine exists; it publishes what it holds and exits on `close`."""

from typing import Callable

from node_agent.engine.engine import Engine
from node_agent.engine.records import StepOutput
from node_agent.serving.output_link import OutputLink
from node_agent.serving.output_messages import Delivery, Feedback, Outgoing
from node_agent.serving.publisher import Publisher
from shared.settings import NodeSettings


class ReplicaOutput:
    def __init__(
        self,
        settings: NodeSettings,
        node: str,
        model: str,
        publisher: Publisher,
        on_feedback: Callable[[Feedback], None],
        on_exit: Callable[[str], None],
        link_type: Callable[..., OutputLink] = OutputLink,
    ):
        """`link_type(config, on_feedback, on_exit)`: the link to the output side (a simulated node's
        keeps that side in its own process: node_agent/sim/output.py)."""
        self.link_type = link_type
        self.config = dict(
            redis_url=settings.redis_url,
            key_prefix=settings.key_prefix,
            node=node,
            model=model,
            log_level=settings.log_level,
            stream_retention_s=settings.stream_retention_s,
            max_event_bytes=settings.max_event_bytes,
            whole_flush_s=settings.whole_flush_s,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
        )
        self.publisher, self.on_feedback, self.on_exit = publisher, on_feedback, on_exit
        self.link: OutputLink | None = None  # while the replica is loaded

    async def start(self) -> None:
        """Start the output process (it imports while the model loads)."""
        self.link = self.link_type(self.config, self.on_feedback, self.on_exit)
        await self.link.start()

    @property
    def alive(self) -> bool:
        return self.link is not None and self.link.alive

    def open(self, engine: Engine) -> None:
        """Hand the process the engine's tokenizer: from now on the engine's steps go to it."""
        self.link.open(engine.text)

    def step(self, out: StepOutput) -> None:
        """One engine step's record (the device thread calls this)."""
        self.link.step(out)

    def send(self, items: list[Outgoing], deliveries: list[Delivery] = ()) -> None:
        if self.alive:
            self.link.publish(items, deliveries)
        else:
            self.publisher.send(items)

    async def close(self) -> None:
        if self.link is not None:
            link, self.link = self.link, None
            await link.close()
