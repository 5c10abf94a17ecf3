"""An embedding or rerank model on one node (catalogue `kind` "embedding" or "rerank"): a
`ServedModel` whose engine is a `PoolingEngine` (node_agent/engine/pooler.py). It reads the
model's job streams as every model does; each job's inputs are tokenised in the thread pool
(node_agent/serving/pooling_inputs.py) and queued on the device thread, which runs them with its
other engines' steps. A job's result leaves as one done event carrying its vectors or scores,
published from here with the job's acknowledgement (no output process: there is no text to make)."""

import asyncio
import logging

from node_agent.engine.pooler import Encoded, PoolingEngine, PoolingStep
from node_agent.model import pooling
from node_agent.serving.job_trace import JobTrace
from node_agent.serving.pooling_inputs import encode
from node_agent.serving.publisher import Outgoing
from node_agent.serving.served_model import Running, ServedModel
from shared.catalog import ModelProfile
from shared.errors import CortexError, GenerationFailed
from shared.heartbeat import ModelInfo
from shared.model_files import ModelLoadError
from shared.settings import NodeSettings
from shared.wire import POOLING_KINDS, DoneEvent, ErrorEvent, StreamEntry, Usage, WireError

log = logging.getLogger(__name__)

Queued = tuple[str, Encoded, int | None, float]  # job, its inputs, dimensions, submitted ms


def _start(profile: ModelProfile, device: str, settings: NodeSettings) -> PoolingEngine:
    """On the device thread: load the model and build its engine."""
    if profile.tensor_parallel > 1:
        raise ModelLoadError(f"{profile.id}: embedding and rerank models run on one device (tensor_parallel = 1)")
    return PoolingEngine(pooling.load(profile, device, settings.hf_cache), profile)


def served_class(profile: ModelProfile) -> type[ServedModel]:
    """What serves a model of the profile's kind on a node."""
    return ServedModel if profile.kind == "generate" else ServedPooler


def _add_all(engine: PoolingEngine, jobs: list[Queued]) -> None:
    for job in jobs:
        engine.add(*job)


class ServedPooler(ServedModel):
    engine: PoolingEngine | None

    async def _open(self) -> None:
        self.engine = await self.device.call(_start, self.profile, self.devices[0], self.settings)
        await self.device.attach(self.engine, self._on_step, self.on_failure)
        self.reserved_mb = self.memory_mb
        log.info("%s: forward passes of up to %d tokens, %s", self.profile.id, self.engine.budget,
                 "packed (no padding)" if self.engine.packed else "padded to each pass's longest input")

    @property
    def memory_mb(self) -> int:
        held = self.engine.memory_bytes() if self.engine is not None else 0
        return max(self.reserved_mb, held >> 20)

    def info(self) -> ModelInfo:
        return ModelInfo(state=self.state, device=self.device.device, devices=self.devices,
                         slots_total=self.profile.slots, slots_used=self.used_slots, memory_mb=self.memory_mb,
                         max_model_len=self.engine.max_len if self.engine is not None else 0,
                         last_used_ms=self.last_used_ms, error=self.error)

    async def _prepare(self, entry_id: str, fields: dict[bytes, bytes], stream: str = "",
                       job_class: str = "interactive") -> Queued | None:
        """Read and tokenise one entry; None when it ended here (refused or failed)."""
        stream = stream or self.stream
        try:
            entry = StreamEntry.from_fields(fields)
            if entry.kind not in POOLING_KINDS:
                raise WireError(f"a {entry.kind} job for {self.profile.kind} model {self.profile.id}")
            request = entry.pooling_request()
        except WireError as exc:
            log.error("refusing entry %s on %s: %s", entry_id, stream, exc)
            reply = fields.get(b"reply", b"").decode()
            self._finish(entry_id, reply, ErrorEvent(code="invalid_request", message=str(exc)), stream)
            return None
        self.running[request.job] = Running(entry_id, entry.reply, 1, entry.keep_alive_s, stream=stream,
                                            job_class=job_class, trace=JobTrace.of(entry, entry_id, self.consumer_name))
        log.info("job=%s request=%s: %d inputs to %s, from %s", request.job, entry.request_id, len(request.inputs),
                 request.kind, entry_id)
        try:
            self._check_memory()
            encoded = await asyncio.to_thread(encode, self.engine.lm, request)
        except CortexError as exc:
            self.fail(request.job, exc)
            return None
        except Exception as exc:
            log.exception("job %s could not start", request.job)
            self.fail(request.job, GenerationFailed(f"{type(exc).__name__}: {exc}"))
            return None
        return request.job, encoded, request.dimensions, float(entry.submitted_ms)

    async def _add(self, jobs: list[Queued]) -> None:
        """Queue a read's jobs on the device thread, but those cancelled while they were tokenised."""
        if jobs := [job for job in jobs if job[0] in self.running]:
            await self.device.call(_add_all, self.engine, jobs)

    def _on_step(self, out: PoolingStep) -> None:
        """On the device thread: hand the step's finished jobs to the event loop."""
        self.device.loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: PoolingStep) -> None:
        """Publish each finished job's result with its acknowledgement (a job cancelled meanwhile has
        ended already), then free its slot."""
        items, ended = [], []
        for done in out.done:
            running = self.running.get(done.job)
            if running is None:
                continue
            event = DoneEvent(usage=Usage(prompt_tokens=done.prompt_tokens), timings=done.timings,
                              node=self.consumer_name, pooled=done.pooled)
            items.append(Outgoing(running.reply, [event], (running.stream, running.entry_id), job=done.job))
            ended.append(done)
        self._send(items)
        for done in ended:
            self._release(done.job, done.timings)
