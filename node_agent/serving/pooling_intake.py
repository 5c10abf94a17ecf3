"""An embedding or rerank model's intake (the `Intake` of node_agent/serving/intake.py for a
`PoolingEngine`): each stream entry is decoded as a `PoolingRequest`, admitted to the ledger, its
inputs tokenised and checked in the thread pool (node_agent/serving/pooling_inputs.py) against the
device's free memory too, and a read's jobs are queued on the device thread together, but those
cancelled while they were tokenised. An entry that cannot run ends here with its error. Once its
inputs are tokenised their tokens are what the job is charged if it ends early (cancelled, failed:
node_agent/serving/ledger.py); a finished job is charged with its result (served_pooler.py)."""

import asyncio
import logging

from node_agent.engine.pooler import Encoded, PoolingEngine
from node_agent.serving.intake import Intake
from node_agent.serving.job_reader import Entry
from node_agent.serving.job_spans import JobSpans
from node_agent.serving.ledger import Running
from node_agent.serving.pooling_inputs import encode
from shared.errors import InvalidRequest
from shared.wire import POOLING_KINDS, PoolingRequest, StreamEntry, Usage, WireError

log = logging.getLogger(__name__)

Queued = tuple[
    PoolingRequest, Encoded, float
]  # the request, its inputs' token ids, when it was submitted (ms)


def _add_all(engine: PoolingEngine, jobs: list[Queued]) -> None:
    for request, encoded, submitted_ms in jobs:
        engine.add(request.job, encoded, request.dimensions, submitted_ms)


class PoolingIntake(Intake):
    engine: PoolingEngine | None

    def attach(self, engine: PoolingEngine) -> None:
        self.engine = engine

    async def add(self, jobs: list[Queued]) -> None:
        if jobs := [job for job in jobs if job[0].job in self.ledger]:
            await self.device.call(_add_all, self.engine, jobs)

    async def prepare(self, e: Entry) -> Queued | None:
        """Decode, tokenise and check one entry; None when it ended here (refused or failed)."""
        stream = e.stream or self.ledger.stream
        try:
            entry = StreamEntry.from_fields(e.fields)
            if entry.kind not in POOLING_KINDS:
                raise WireError(
                    f"a {entry.kind} job for {self.profile.kind} model {self.profile.id}"
                )
            request = entry.pooling_request()
        except (
            Exception
        ) as exc:  # WireError, or bytes that are not even text: the entry alone is refused
            log.error(
                "refusing entry %s on %s: %s: %s", e.entry_id, stream, type(exc).__name__, exc
            )
            channel = StreamEntry.channel_of(e.fields)
            self.ledger.refuse(
                e.entry_id, channel, InvalidRequest(f"an unreadable job entry: {exc}"), stream
            )
            return None
        self.ledger.admit(
            request.job,
            Running(
                e.entry_id,
                entry.channel,
                1,
                entry.keep_alive_s,
                stream=stream,
                job_class=e.job_class,
                trace=JobSpans.of(entry, e.entry_id, self.node),
                api_key=entry.api_key or "",
                tenant=entry.tenant or "",
            ),
        )
        log.info(
            "job=%s request=%s: %d inputs to %s, from %s",
            request.job,
            entry.request_id,
            len(request.inputs),
            request.kind,
            e.entry_id,
        )
        try:
            self._check_memory()
            encoded = await asyncio.to_thread(
                encode, self.engine.lm, request, self.settings.max_pooled_floats
            )
        except Exception as exc:
            self.failed(request.job, exc)
            return None
        if (running := self.ledger.running.get(request.job)) is not None:
            # from now on its inputs hold the engine: ended early (cancelled, failed), it pays them
            running.used = Usage(prompt_tokens=encoded.tokens)
        return request, encoded, float(entry.submitted_ms)
