"""One model replica on one node: its way up and down (pull, load, sleep, wake, unload) along the
state table in node_agent/serving/replica.py, its engine on a device thread and its output process.
The parts do one job each: the ledger (node_agent/serving/ledger.py) holds its jobs and slots, the
intake (intake.py) turns stream entries into engine requests, the consumer (consumer.py) reads the
model's job streams only as far as the ledger has free slots, and its faults (replica_faults.py)
make every move to `poisoned` or `failed`. The device thread hands each step's record straight to
the output process (replica_output.py), whose feedback says which jobs ended; a device error, or
the output process dying, poisons the replica (its jobs fail, it is reloaded)."""

import asyncio
import logging
import time

import redis.asyncio as aioredis

from node_agent.engine.engine import Engine
from node_agent.model import devices
from node_agent.serving.consumer import Consumer
from node_agent.serving.device_thread import DeviceThread
from node_agent.serving.engine_start import start_engine
from node_agent.serving.intake import Intake
from node_agent.serving.job_reader import JobReader
from node_agent.serving.ledger import Ledger, now_ms
from node_agent.serving.output_link import OutputLink
from node_agent.serving.output_messages import Feedback
from node_agent.serving.publisher import Publisher
from node_agent.serving.replica import Replica
from node_agent.serving.replica_faults import ReplicaFaults
from node_agent.serving.replica_output import ReplicaOutput
from node_agent.weights.puller import Pull
from shared.catalog import ModelProfile
from shared.errors import CortexError, JobCancelled, ModelLoadFailed, ModelPullFailed, NodeLost
from shared.heartbeat import ModelInfo
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.settings import NodeSettings

log = logging.getLogger(__name__)


class OutputProcessExited(RuntimeError):
    """The output process died: like a device fault, the jobs in flight fail and the model is reloaded."""


class ServedModel:
    intake_type: type[Intake] = Intake  # what turns its stream entries into engine requests
    engine_start = staticmethod(start_engine)  # on the device: the model loaded, its engine built

    def __init__(
        self,
        profile: ModelProfile,
        device: DeviceThread,
        redis: aioredis.Redis,
        keys: Keys,
        publisher: Publisher,
        consumer_name: str,
        settings: NodeSettings,
        devices: list[str] | None = None,
        *,
        load_from: ModelProfile | None = None,
        pull: Pull | None = None,
    ):
        """`load_from`: the profile the engine loads (its source the files' folder on this node, when
        pulled); `pull`: its files are on their way (the replica starts `downloading`, see `fetch`)."""
        self.profile, self.device = profile, device
        self.load_from = load_from or profile
        self.devices = devices or [device.device]  # rank 0's first when tensor-parallel
        self.publisher, self.consumer_name, self.settings = publisher, consumer_name, settings
        self.replica = Replica(
            profile.id, state=ModelState.LOADING if pull is None else ModelState.DOWNLOADING
        )
        self.pull = pull  # while downloading
        self.engine: Engine | None = None
        self.output = ReplicaOutput(
            settings,
            consumer_name,
            profile.id,
            publisher,
            self.on_feedback,
            lambda reason: self.faults.poison(
                OutputProcessExited(reason), list(self.ledger.running)
            ),
            self.output_link,
        )
        self.reserved_mb = profile.memory_mb or 0  # reserved from the start when the catalogue says
        self.reader = JobReader(redis, keys, profile.id, consumer_name, settings.batch_max_wait_s)
        self.ledger = Ledger(profile, settings, keys.jobs(profile.id), self.output.send)
        self.intake = self.intake_type(
            profile, settings, consumer_name, device, self.ledger, self.output.send
        )
        self.consumer = Consumer(self.reader, self.ledger, self.intake)
        self.faults = ReplicaFaults(self)  # every move to `poisoned` or `failed`
        # held while it falls asleep, wakes or unloads: one at a time
        self._resting = asyncio.Lock()

    def output_link(self, config: dict, on_feedback, on_exit) -> OutputLink:
        """The link to this replica's output side: its own process (node_agent/serving/output_link.py)."""
        return OutputLink(config, on_feedback, on_exit)

    @property
    def state(self) -> ModelState:
        return self.replica.state

    def info(self) -> ModelInfo:
        return ModelInfo(
            state=self.state,
            device=self.device.device,
            devices=self.devices,
            slots_total=self.profile.slots,
            slots_used=self.ledger.used_slots,
            memory_mb=self.memory_mb,
            last_used_ms=self.ledger.last_used_ms,
            keep_until_ms=self.ledger.keep_until_ms,
            error=self.replica.error,
            download=self.pull.progress() if self.pull is not None else None,
            **(self.engine.replica_facts() if self.engine is not None else {}),
        )

    @property
    def memory_mb(self) -> int:
        """The catalogue's reservation, or what the engine holds once that is more (graphs captured
        as traffic reaches new shapes make it grow); every rank holds as much as rank 0."""
        engine = self.engine
        held = (
            engine.memory_bytes() * self.profile.tensor_parallel
            if engine is not None and engine.decoder
            else 0
        )
        return max(self.reserved_mb, held >> 20)

    async def fetch(self) -> bool:
        """`downloading` → `loading` once its pull has every file here, checked; → `failed` when it fails
        (with the jobs that waited for this replica alone). False: do not load (failed, or unloaded meanwhile)."""
        try:
            folder = await self.pull.wait()
        except asyncio.CancelledError:
            if not self.pull.task.cancelled():
                raise  # this replica's load was cancelled, not the pull
            await self.faults.load_failed(
                ModelPullFailed(
                    f"the pull of {self.profile.id}'s files stopped: the node is shutting down"
                )
            )
            return False
        except Exception as exc:
            await self.faults.load_failed(exc)
            return False
        finally:
            self.pull = None
        if not self.replica.can(ModelState.LOADING):
            return False
        self.load_from = self.profile.model_copy(update={"source": str(folder)})
        self.replica.to(ModelState.LOADING)
        return True

    async def load(self) -> None:
        """`loading` (or `poisoned`: a reload) → `ready`; or → `failed`, with the jobs that waited for
        this replica alone failed."""
        try:
            await self._open()
            self.reserved_mb = (
                self.memory_mb
            )  # what it held once loaded stays reserved across a reload
            await self.reader.ensure_groups()
            self.replica.to(ModelState.READY)
        except Exception as exc:
            await self.faults.load_failed(exc)
            return
        self.ledger.last_used_ms = now_ms()
        self.consumer.start()
        log.info(
            "%s ready on %s (%d slots)",
            self.profile.id,
            ", ".join(self.devices),
            self.profile.slots,
        )

    async def _open(self) -> None:
        """Start the output process, build the engine on the device thread and step it there; a
        sleeping replica's engine and output process were kept (the latter started again if it died)."""
        starts_output = self.engine is None or not self.output.alive
        if starts_output:
            await self.output.start()  # it starts up while the model loads
        if self.engine is None:
            self.engine = await self.device.call(
                self.engine_start, self.load_from, self.devices, self.settings, self.consumer_name
            )
        self.check_still_loading()
        self.intake.attach(self.engine)
        if starts_output:
            self.output.open(self.engine)
        await self.device.attach(self.engine, self.output.step, self.faults.on_failure)

    def check_still_loading(self) -> None:
        """Raise when the replica was given up (overdue, unloaded) while its engine was being built."""
        if self.state not in (ModelState.LOADING, ModelState.POISONED):
            raise ModelLoadFailed(f"the load finished after the replica was {self.state}")

    def on_feedback(self, feedback: Feedback) -> None:
        """From the output process: sequences to free, jobs that ended, jobs to cancel."""
        if feedback.stopped and self.engine is not None:
            self.device.call(self.engine.stop, feedback.stopped)
        for job in feedback.ended:
            self.ledger.end(job, feedback.timings.get(job))
        for job in feedback.unheard:
            self.publisher.on_unheard(job)
        for job in feedback.lost:
            self.publisher.on_lost(job)

    @property
    def can_sleep(self) -> bool:
        """A generating model on one CPU device, ready: its engine may be kept in the host's memory
        (on a GPU that memory is the device's; a tensor-parallel model's ranks are other threads)."""
        return (
            self.state == ModelState.READY
            and isinstance(self.engine, Engine)
            and self.devices == [self.device.device]
            and devices.is_cpu(self.device.device)
        )

    async def sleep(self, grace_s: float) -> None:
        """`ready` → `sleeping`: stop reading (running jobs get `grace_s`) and stepping, leave the job
        streams; the engine stays, with its compiled step and cached prefixes, and its output process
        (idle), for the load that wakes it (`wake`)."""
        async with self._resting:  # a load that comes meanwhile wakes it once it is asleep
            self.replica.to(ModelState.SLEEPING)
            await self.stop_taking(grace_s)
            await self.device.detach(self.engine)
            await self.reader.leave()
        log.info(
            "%s sleeps on %s (%d MB kept)", self.profile.id, self.device.device, self.memory_mb
        )

    async def wake(self) -> None:
        """`sleeping` → `loading` → `ready` with the engine it kept (a failure: `failed`, as a load's)."""
        started = time.monotonic()
        async with self._resting:
            if self.state != ModelState.SLEEPING:  # unloaded while it fell asleep
                return
            self.replica.to(ModelState.LOADING)
            await self.load()
        log.info("%s woke in %.2f s", self.profile.id, time.monotonic() - started)

    async def unload(self, grace_s: float) -> None:
        """Finish (within `grace_s`) or fail running jobs, then free the device memory (once it fell
        asleep, when it was falling asleep)."""
        async with self._resting:
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
            await self.device.call(engine.free)
        await self.output.close()

    async def cancel(self, job: str, error: CortexError | None = None) -> None:
        """Drop the job from the engine; a client still listening is told it was cancelled (or `error`)."""
        if job in self.ledger and self.engine is not None:
            await self.device.call(self.engine.cancel, job)
            self.ledger.fail(job, error or JobCancelled(f"job {job} was cancelled"))

    async def drain(self, grace_s: float) -> None:
        """`unloading`: stop reading; let running jobs finish within `grace_s`, fail the rest."""
        if self.replica.can(ModelState.UNLOADING):
            self.replica.to(ModelState.UNLOADING)
        await self.stop_taking(grace_s)

    async def stop_taking(self, grace_s: float) -> None:
        """Stop reading; let running jobs finish within `grace_s`, fail the rest."""
        await self.consumer.stop()
        deadline = time.monotonic() + grace_s
        while self.ledger.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.ledger.running):
            if self.engine is not None:
                await self.device.call(self.engine.cancel, job)
            self.ledger.fail(
                job, NodeLost(f"node {self.consumer_name} shut down before the job finished")
            )
