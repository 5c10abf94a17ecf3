"""An embedding or rerank model on one node (catalogue `kind` "embedding" or "rerank"): a
`ServedModel` whose engine is a `PoolingEngine` (node_agent/engine/pooler.py) and whose intake is a
`PoolingIntake` (node_agent/serving/pooling_intake.py). It reads the model's job streams, holds its
jobs in its ledger and goes through the replica's states as every model does; the device thread
steps its engine with its other engines. A job's result leaves as one done event carrying its
vectors or scores, published from here with the job's acknowledgement (no output process: there
is no text to make)."""

import logging

from node_agent.engine.pooler import PooledJob, PoolingEngine, PoolingStep
from node_agent.serving.engine_start import start_pooler
from node_agent.serving.ledger import Running
from node_agent.serving.output_messages import Charge, Outgoing
from node_agent.serving.pooling_intake import PoolingIntake
from node_agent.serving.served_model import ServedModel
from shared.catalog import ModelProfile
from shared.wire import DoneEvent, Usage

log = logging.getLogger(__name__)


def served_class(profile: ModelProfile) -> type[ServedModel]:
    """What serves a model of the profile's kind on a node."""
    return ServedModel if profile.kind == "generate" else ServedPooler


class ServedPooler(ServedModel):
    intake_type = PoolingIntake
    engine: PoolingEngine | None

    async def _open(self) -> None:
        self.engine = await self.device.call(
            start_pooler, self.load_from, self.devices[0], self.settings
        )
        self.check_still_loading()
        self.intake.attach(self.engine)
        await self.device.attach(self.engine, self._on_step, self.faults.on_failure)
        log.info(
            "%s: forward passes of up to %d tokens, %s",
            self.profile.id,
            self.engine.budget,
            "packed (no padding)" if self.engine.packed else "padded to each pass's longest input",
        )

    @property
    def memory_mb(self) -> int:
        held = self.engine.memory_bytes() if self.engine is not None else 0
        return max(self.reserved_mb, held >> 20)

    def _on_step(self, out: PoolingStep) -> None:
        """On the device thread: hand the step's finished jobs to the event loop."""
        self.device.loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: PoolingStep) -> None:
        """Publish each finished job's result with its acknowledgement (a job cancelled meanwhile has
        ended already), then free its slot."""
        finished = [
            (done, self.ledger.running[done.job]) for done in out.done if done.job in self.ledger
        ]
        self.output.send([self._outgoing(done, running) for done, running in finished], [])
        for done, _ in finished:
            self.ledger.end(done.job, done.timings)

    def _outgoing(self, done: PooledJob, running: Running) -> Outgoing:
        usage = Usage(prompt_tokens=done.prompt_tokens)
        return Outgoing(
            running.channel,
            [
                DoneEvent(
                    usage=usage, timings=done.timings, node=self.consumer_name, pooled=done.pooled
                )
            ],
            (running.stream, running.entry_id),
            job=done.job,
            charge=Charge(running.api_key, usage) if running.api_key else None,
        )
