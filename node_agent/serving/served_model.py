"""One model on one node: its engine on a device thread, its output process, and the consumer that
feeds it from the model's job streams (through its `JobReader`), reading only as many entries as
it has free slots. The device thread hands each step's record straight to the output process
(through its `OutputLink`), which publishes the events and says which jobs ended; a device error,
or the output process dying, poisons the model (its jobs fail, it is reloaded)."""

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError, ResponseError

from node_agent.model import loader
from node_agent.serving import prompts
from node_agent.tp import tensor_parallel
from node_agent.serving.device_thread import DeviceThread
from node_agent.engine.engine import Engine, check_fits
from node_agent.serving.job_reader import JobReader
from node_agent.serving.job_trace import JobTrace
from node_agent.serving.limits import completion_budget
from node_agent.serving.output_link import OutputLink
from node_agent.serving.output_process import Feedback, Route
from node_agent.serving.publisher import Outgoing, Publisher
from shared.catalog import ModelProfile
from shared.errors import (CortexError, GenerationFailed, InsufficientMemory, JobCancelled,
                           ModelLoadFailed, ModelPoisoned, NodeLost)
from shared.heartbeat import ModelInfo
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.redis_conn import Outage
from shared.settings import NodeSettings
from shared.wire import DoneEvent, ErrorEvent, GenerationRequest, StartEvent, StreamEntry, Timings, Usage, WireError

log = logging.getLogger(__name__)


def _free(engine: Engine) -> None:
    """Drop an engine's tensors on the device thread and give the memory back."""
    engine.release()
    if engine.lm.device.type == "cuda":
        torch.cuda.empty_cache()


def _start_engine(profile: ModelProfile, device_ids: list[str], settings: NodeSettings, node: str) -> Engine:
    """On the device thread: load the model (sharded over `device_ids` when tensor-parallel) and
    build its engine; a tensor-parallel model's other ranks stop if that fails."""
    if profile.tensor_parallel > 1:
        loaded = tensor_parallel.load(profile, device_ids, settings, node)
    else:
        loaded = loader.load(profile, device_ids[0], settings.hf_cache, settings.convert_cache)
    try:
        return Engine(loaded, profile, node)
    except BaseException:
        if loaded.group is not None:
            loaded.group.close()
        raise


Prepared = tuple[GenerationRequest, list[int], float, dict[str, np.ndarray]]  # request, prompt ids, submitted, images


def _add_each(engine: Engine, jobs: list[Prepared]) -> list[tuple[str, CortexError]]:
    """On the device thread: add each job; returns the jobs the engine refused, with why."""
    refused = []
    for request, ids, submitted_ms, images in jobs:
        try:
            engine.add(request, ids, submitted_ms, images)
        except CortexError as exc:
            refused.append((request.job, exc))
        except Exception as exc:
            log.exception("job %s could not start", request.job)
            refused.append((request.job, GenerationFailed(f"{type(exc).__name__}: {exc}")))
    return refused


@dataclass
class Running:
    entry_id: str
    reply: str
    sequences: int
    keep_alive_s: float | None = None
    stream: str = ""  # the job stream it came from (shared/queues.py), acknowledged there
    job_class: str = "interactive"
    streaming: bool = False  # a client streams it: its first output is noted (`Keys.started`)
    trace: JobTrace | None = None  # when its request is traced: its spans are made when it ends


def _now_ms() -> int:
    return int(time.time() * 1000)


KEEP_ALIVE_MAX_MS = 7 * 24 * 3600 * 1000  # the gateway's bound too (gateway/protocol/bounds.py)


def _keep_alive_ms(keep_alive_s: float) -> int:
    """A request's keep_alive in ms, within bounds whatever came over the wire (inf, nan included)."""
    return int(min(max(keep_alive_s * 1000, 0), KEEP_ALIVE_MAX_MS)) if keep_alive_s == keep_alive_s else 0


class OutputProcessExited(RuntimeError):
    pass


class ServedModel:
    def __init__(self, profile: ModelProfile, device: DeviceThread, redis: aioredis.Redis, keys: Keys,
                 publisher: Publisher, consumer_name: str, settings: NodeSettings, devices: list[str] | None = None):
        self.profile, self.device = profile, device
        self.devices = devices or [device.device]  # rank 0's first when tensor-parallel
        self.publisher, self.consumer_name, self.settings = publisher, consumer_name, settings
        self.stream = keys.jobs(profile.id)
        self.reader = JobReader(redis, keys, profile.id, consumer_name, settings.batch_max_wait_s)
        self.state = ModelState.LOADING
        self.error = ""
        self.engine: Engine | None = None
        self.link: OutputLink | None = None  # to the model's output process, while loaded
        self.max_prompt_chars: int | None = None  # longer prompts cannot fit: refused before tokenising
        self.reserved_mb = profile.memory_mb or 0  # reserved from the start when the catalogue says
        self.last_used_ms = _now_ms()
        self.keep_until_ms = 0  # a request's keep_alive holds the model at least until then
        self.running: dict[str, Running] = {}
        self._slot_freed = asyncio.Event()
        self._consumer: asyncio.Task | None = None
        self._adding: set[asyncio.Task] = set()  # hand-offs of read jobs to the device thread in flight
        self._consuming = False
        self._settle = False  # Redis came back: settle the entries it holds for jobs no longer here
        self._read_after = 0.0  # monotonic time before which the consumer reads nothing (pause_reading)

    @property
    def used_slots(self) -> int:
        return sum(r.sequences for r in self.running.values())

    def info(self) -> ModelInfo:
        return ModelInfo(state=self.state, device=self.device.device, devices=self.devices,
                         slots_total=self.profile.slots, slots_used=self.used_slots, memory_mb=self.memory_mb,
                         max_model_len=self.engine.max_len if self.engine is not None else 0,
                         last_used_ms=self.last_used_ms, error=self.error,
                         kv=self.engine.kv_stats() if self.engine is not None else None)

    @property
    def memory_mb(self) -> int:
        """The catalogue's reservation, or what the engine holds once that is more (graphs captured
        as traffic reaches new shapes make it grow); every rank holds as much as rank 0."""
        engine = self.engine
        held = engine.memory_bytes() * self.profile.tensor_parallel if engine is not None and engine.decoder else 0
        return max(self.reserved_mb, held >> 20)

    def idle_expired(self, now_ms: int) -> bool:
        """Idle past its keep_alive (and past any request's keep_alive)."""
        keep_alive_ms = self.profile.keep_alive_s * 1000
        return (self.state == ModelState.READY and not self.running and keep_alive_ms >= 0
                and now_ms >= max(self.last_used_ms + keep_alive_ms, self.keep_until_ms))

    async def load(self) -> None:
        try:
            await self._open()
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("loading %s failed: %s", self.profile.id, self.error)
            await self._close_link()
            await self._fail_waiting(ModelLoadFailed(f"loading {self.profile.id} on {self.consumer_name} failed: "
                                                     f"{self.error}"))
            return
        await self.reader.ensure_groups()
        self.state, self.error, self.last_used_ms = ModelState.READY, "", _now_ms()
        self._consuming = True
        self._consumer = asyncio.create_task(self._consume(), name=f"consume-{self.profile.id}")
        log.info("%s ready on %s (%d slots)", self.profile.id, ", ".join(self.devices), self.profile.slots)

    async def _open(self) -> None:
        """Start the output process, load the engine on the device thread and attach it there."""
        self.link = OutputLink(dict(redis_url=self.settings.redis_url, key_prefix=self.settings.key_prefix,
                                    node=self.consumer_name, model=self.profile.id,
                                    log_level=self.settings.log_level,
                                    stream_retention_s=self.settings.stream_retention_s,
                                    heartbeat_ttl_s=self.settings.heartbeat_ttl_s),
                               self.on_feedback, self.on_output_exit)
        await self.link.start()  # it starts up while the model loads
        self.engine = await self.device.call(_start_engine, self.profile, self.devices, self.settings,
                                             self.consumer_name)
        max_tokens = min(self.engine.max_len, self.profile.max_prompt_tokens or self.engine.max_len)
        self.max_prompt_chars = max_tokens * prompts.longest_token_chars(self.engine.lm.tokenizer)
        self.link.open(self.engine.text)
        await self.device.attach(self.engine, self.link.step, self.on_failure)
        self.reserved_mb = self.memory_mb  # what it held once loaded stays reserved across a reload

    def on_failure(self, exc: BaseException, jobs: list[str], device_fault: bool) -> None:
        """A step failed on the device thread (its jobs are out of the engine): a fault of the device
        poisons the model; anything else fails those jobs only."""
        if device_fault:
            self.poison(exc, jobs)
            return
        error = GenerationFailed(f"the engine step failed ({type(exc).__name__}: {exc}); the model is still served, "
                                 "try again")
        for job in jobs:
            self.fail(job, error)

    def on_output_exit(self, reason: str) -> None:
        """The output process died: like a device fault, the jobs in flight fail and the model is reloaded."""
        self.poison(OutputProcessExited(reason), list(self.running))

    def on_feedback(self, feedback: Feedback) -> None:
        """From the output process: sequences to free, jobs that ended, jobs to cancel."""
        if feedback.stopped and self.engine is not None:
            self.device.call(self.engine.stop, feedback.stopped)
        for job in feedback.ended:
            self._release(job, feedback.timings.get(job))
        for job in feedback.unheard:
            self.publisher.on_unheard(job)
        for job in feedback.lost:
            self.publisher.on_lost(job)

    def poison(self, exc: BaseException, jobs: list[str]) -> None:
        """A device error: fail this model's jobs with a 503 that says why, stop reading, then reload
        it (once: jobs the reader handed over before it stopped fail too, with the same error)."""
        if self.state != ModelState.POISONED:
            self.state, self.error = ModelState.POISONED, f"{type(exc).__name__}: {exc}"
            log.error("%s is poisoned (%s); reloading it", self.profile.id, self.error)
            self._consuming = False  # the slots freed below must not wake the reader
            asyncio.get_running_loop().create_task(self._reload(), name=f"reload-{self.profile.id}")
        self._fail_poisoned(jobs)

    def _fail_poisoned(self, jobs: list[str] = ()) -> None:
        for job in set(jobs) | set(self.running):
            self.fail(job, ModelPoisoned(f"{self.profile.id} failed on {self.consumer_name} "
                                         f"({', '.join(self.devices)}): {self.error}; it is being reloaded"))

    async def _reload(self) -> None:
        await self.stop_consuming()
        self._fail_poisoned()  # handed over by the reader's last read: the engine they went to is dropped
        await self.free()
        await self.load()
        self.error = "" if self.state == ModelState.READY else self.error

    async def _fail_waiting(self, error: CortexError) -> None:
        """Fail the jobs waiting for this model (they waited for this load) with its error."""
        await self.reader.ensure_groups()
        while entries := await self.reader.backlog():
            for e in entries:
                self._finish(e.entry_id, e.fields.get(b"reply", b"").decode(),
                             ErrorEvent(code=error.code, message=error.message), e.stream,
                             e.fields.get(b"job", b"").decode())

    async def unload(self, grace_s: float) -> None:
        """Finish (within `grace_s`) or fail running jobs, then free the device memory."""
        await self.drain(grace_s)
        await self.free()
        await self.reader.leave()
        log.info("%s unloaded from %s", self.profile.id, self.device.device)

    async def free(self) -> None:
        """Stop stepping the engine and drop it (a tensor-parallel model's other ranks with it); the
        output process publishes what it holds and exits."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await self.device.detach(engine)
            await self.device.call(_free, engine)
        await self._close_link()

    async def _close_link(self) -> None:
        if self.link is not None:
            link, self.link = self.link, None
            await link.close()

    def _batch_free(self, free: int) -> int:
        """Slots batch jobs may take now: they leave `interactive_reserved_slots` to interactive ones."""
        reserved = min(self.settings.interactive_reserved_slots, self.profile.slots - 1)
        batch_used = sum(r.sequences for r in self.running.values() if r.job_class == "batch")
        return max(0, min(free, self.profile.slots - reserved - batch_used))

    async def stop_consuming(self) -> None:
        """Stop reading. The reader is let finish its current read (at most a block timeout) and
        admit what it got: cancelling it mid-read could strand entries Redis already handed over."""
        if self._consumer:
            self._consuming = False
            self._slot_freed.set()
            await asyncio.gather(self._consumer, return_exceptions=True)
            await asyncio.gather(*self._adding, return_exceptions=True)
            self._consumer = None

    def pause_reading(self, seconds: float) -> None:
        """Read no new job for `seconds`: a gateway that lost Redis is subscribing again to its jobs
        still queued, and a job read before it listens again fails there (gateway/events.py)."""
        self._read_after = max(self._read_after, time.monotonic() + seconds)

    def redis_came_back(self) -> None:
        """Redis restarted (from its append-only file, which may lack its last second): before its next
        read the consumer acknowledges what Redis holds as delivered to this node but no job here runs
        (jobs whose acks Redis lost)."""
        self._settle = True
        self._slot_freed.set()

    async def _settle_orphans(self) -> None:
        self._settle = False
        running = {r.entry_id for r in self.running.values()}
        orphans = [(stream, entry_id) for stream, entry_id in await self.reader.pending() if entry_id not in running]
        if orphans:
            await self.reader.settle(orphans)
            log.info("%s: acknowledged %d entries Redis held for jobs no longer running here", self.profile.id,
                     len(orphans))

    async def _consume(self) -> None:
        outage = Outage(log, f"reading {self.stream}")
        while self._consuming:
            free = self.profile.slots - self.used_slots
            try:
                if self._settle:  # here, between reads: every entry read so far is in `running` or has ended
                    await self._settle_orphans()
                if free <= 0:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                if (paused_s := self._read_after - time.monotonic()) > 0:
                    await asyncio.sleep(paused_s)
                    continue
                entries = await self.reader.read(free, self._batch_free(free))  # most urgent first
                outage.ok()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream or group was deleted under us (a Redis that kept nothing)
                    log.warning("reading %s: %s; recreating the group", self.stream, exc)
                    await self._recreate_groups(outage)
                else:  # Redis refuses: out of memory, read-only, cannot persist
                    outage.failed(exc)
                    await asyncio.sleep(1)
                continue
            except (OSError, RedisError) as exc:
                outage.failed(exc)
                await asyncio.sleep(1)
                continue
            prepared = await asyncio.gather(*(self._prepare(e.entry_id, e.fields, e.stream, e.job_class)
                                              for e in entries))
            # Read on while the device thread takes these: it admits every add queued between two
            # steps, so arrivals a read just missed still join the same prefill.
            adding = asyncio.create_task(self._add([job for job in prepared if job is not None]))
            self._adding.add(adding)
            adding.add_done_callback(self._adding.discard)

    async def _recreate_groups(self, outage: Outage) -> None:
        try:
            await self.reader.ensure_groups()
        except RedisError as exc:
            outage.failed(exc)
            await asyncio.sleep(1)

    async def _add(self, jobs: list[Prepared]) -> None:
        """Hand a read's jobs to the engine in one call: a wave of arrivals joins one prefill step
        instead of trickling in one engine step at a time."""
        if jobs:
            for job, error in await self.device.call(_add_each, self.engine, jobs):
                self.fail(job, error)

    async def _prepare(self, entry_id: str, fields: dict[bytes, bytes], stream: str = "",
                       job_class: str = "interactive") -> Prepared | None:
        """Read, render, tokenise and check one entry; returns what the engine needs, or None
        when the entry ended here (refused, failed, or a count that needs no engine)."""
        stream = stream or self.stream
        reply = fields.get(b"reply", b"").decode()
        try:
            entry = StreamEntry.from_fields(fields)
            request = entry.request()
        except WireError as exc:
            log.error("refusing entry %s on %s: %s", entry_id, self.stream, exc)
            self._finish(entry_id, reply, ErrorEvent(code="invalid_request", message=str(exc)), stream)
            return
        trace = JobTrace.of(entry, entry_id, self.consumer_name)
        self.running[request.job] = Running(entry_id, entry.reply, request.sampling.n, entry.keep_alive_s,
                                            stream=stream, job_class=job_class, streaming=bool(entry.stream),
                                            trace=trace)
        log.info("job=%s request=%s admitted from %s%s", request.job, entry.request_id, entry_id,
                 f" trace={entry.traceparent.split('-')[1]}" if entry.traceparent else "")
        try:
            self._check_memory()
            tokenizing_ns = time.time_ns()
            ids, images = await asyncio.to_thread(self._prompt, request)
            if trace is not None:
                trace.tokenized_ns = (tokenizing_ns, time.time_ns())
            if request.kind == "count":  # count_tokens: the rendered prompt's length; nothing runs
                self._send([Outgoing(entry.reply, [DoneEvent(usage=Usage(prompt_tokens=len(ids)),
                                                             node=self.consumer_name)], (stream, entry_id))])
                self._release(request.job)
                return
            sampling = request.sampling
            sampling.max_tokens = completion_budget(self.profile, self.engine.max_len, len(ids), sampling.max_tokens)
            check_fits(self.engine.max_len, len(ids), sampling.max_tokens, self.profile.max_prompt_tokens)
            self._send([Outgoing(entry.reply, [self._start_event(request, ids)], job=request.job)],
                       [Route(request.job, entry.reply, stream, entry_id, bool(entry.stream))])
            return request, ids, float(entry.submitted_ms), images
        except CortexError as exc:
            self.fail(request.job, exc)
        except Exception as exc:
            log.exception("job %s could not start", request.job)
            self.fail(request.job, GenerationFailed(f"{type(exc).__name__}: {exc}"))
        return None

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], dict[str, np.ndarray]]:
        """In the thread pool: the prompt's token ids, and a vision model's image inputs for it."""
        lm = self.engine.lm
        if lm.processor is not None:
            return prompts.vision_prompt(lm.processor, self.profile, request, self.max_prompt_chars)
        return prompts.prompt_ids(lm.tokenizer, self.profile, request, self.max_prompt_chars), {}

    def _start_event(self, request: GenerationRequest, ids: list[int]) -> StartEvent:
        echo = request.echo and isinstance(request.prompt, list)  # a text prompt the gateway echoes itself
        return StartEvent(prompt_tokens=len(ids), prompt_text=self.engine.lm.tokenizer.decode(ids) if echo else None)

    def _check_memory(self) -> None:
        free = self.device.last_info.free_mb if self.device.last_info else None
        if free is not None and free < self.settings.min_free_mb:
            raise InsufficientMemory(f"{self.device.device} on {self.consumer_name} has {free} MB free, "
                                     f"below min_free_mb={self.settings.min_free_mb}")

    def fail(self, job: str, error: CortexError) -> None:
        running = self.running.get(job)
        if running is not None:
            if running.trace is not None:
                running.trace.error = error.code
            self._finish(running.entry_id, running.reply, ErrorEvent(code=error.code, message=error.message),
                         running.stream, job, running.streaming)
            self._release(job)

    def _finish(self, entry_id: str, reply: str, event: ErrorEvent, stream: str = "", job: str = "",
                tracked: bool = False) -> None:
        self._send([Outgoing(reply, [event] if reply else [], (stream or self.stream, entry_id), job=job,
                             tracked=tracked)])

    def _send(self, items: list[Outgoing], routes: list[Route] = ()) -> None:
        """Through the output process while it runs (after the events it holds for these jobs); else
        straight from here (a model that failed to load, or whose output process died)."""
        if self.link is not None and self.link.alive:
            self.link.publish(items, routes)
        else:
            self.publisher.send(items)

    def _release(self, job: str, timings: Timings | None = None) -> None:
        """The job ended (`timings`: its done event's, when it finished): its slots are free."""
        running = self.running.pop(job, None)
        if running is not None and running.trace is not None:
            running.trace.end(timings)
        self.last_used_ms = _now_ms()
        if running is not None and running.keep_alive_s is not None:
            self.keep_until_ms = max(self.keep_until_ms, self.last_used_ms + _keep_alive_ms(running.keep_alive_s))
        self._slot_freed.set()

    async def cancel(self, job: str, error: CortexError | None = None) -> None:
        """Drop the job from the engine; a client still listening is told it was cancelled (or `error`)."""
        if job in self.running and self.engine is not None:
            await self.device.call(self.engine.cancel, job)
            self.fail(job, error or JobCancelled(f"job {job} was cancelled"))

    async def drain(self, grace_s: float) -> None:
        """Stop reading; let running jobs finish within `grace_s`, fail the rest."""
        self.state = ModelState.UNLOADING
        await self.stop_consuming()
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.running):
            if self.engine is not None:
                await self.device.call(self.engine.cancel, job)
            self.fail(job, NodeLost(f"node {self.consumer_name} shut down before the job finished"))
