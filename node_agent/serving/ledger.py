"""The jobs a replica holds: for each, the slots it takes, the stream entry it came from and where
its answer goes. The one place a job is admitted and ended (finished, failed or cancelled): its
slots are freed once, its entry is acknowledged through the event that ends it (with the count of
what it used against its API key, where the ledger knows it: shared/usage_meter.py), and the
keep-alive its request asked for is noted."""

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from node_agent.serving.job_spans import JobSpans
from node_agent.serving.output_messages import Charge, Delivery, Outgoing
from shared.catalog import ModelProfile
from shared.errors import CortexError
from shared.settings import NodeSettings
from shared.wire import ErrorEvent, Timings, Usage

KEEP_ALIVE_MAX_MS = (
    7 * 24 * 3600 * 1000
)  # the gateway's bound too (gateway/dialects/protocol/bounds.py)

Send = Callable[[list[Outgoing], list[Delivery]], None]


@dataclass
class Running:
    entry_id: str
    channel: str  # the job's event channel
    sequences: int
    keep_alive_s: float | None = None
    stream: str = ""  # the job stream it came from (shared/queues.py), acknowledged there
    job_class: str = "interactive"
    streaming: bool = False  # a client streams it: its first output is noted (`Keys.started`)
    trace: JobSpans | None = None  # when its request is traced: its spans are made when it ends
    api_key: str = ""  # the API key its tokens count against where it ends (none: unmetered)
    tenant: str = ""  # the caller whose waiting room it came through (shared/queues.py)
    # what it used, where the replica itself knows it (a pooled job: its inputs, once tokenised):
    # charged when it fails or is cancelled here (a generation job's output process charges it)
    used: Usage | None = None


def now_ms() -> int:
    return int(time.time() * 1000)


def keep_alive_ms(keep_alive_s: float) -> int:
    """A request's keep_alive in ms, within bounds whatever came over the wire (inf, nan included)."""
    return (
        int(min(max(keep_alive_s * 1000, 0), KEEP_ALIVE_MAX_MS))
        if keep_alive_s == keep_alive_s
        else 0
    )


class Ledger:
    def __init__(self, profile: ModelProfile, settings: NodeSettings, stream: str, send: Send):
        self.profile, self.settings, self.stream, self._send = profile, settings, stream, send
        self.running: dict[str, Running] = {}
        self.slot_freed = asyncio.Event()
        self.last_used_ms = now_ms()
        self.keep_until_ms = 0  # a request's keep_alive holds the model at least until then

    def __contains__(self, job: str) -> bool:
        return job in self.running

    @property
    def used_slots(self) -> int:
        return sum(r.sequences for r in self.running.values())

    @property
    def free_slots(self) -> int:
        return self.profile.slots - self.used_slots

    def batch_free(self, free: int) -> int:
        """Slots batch jobs may take now: they leave `interactive_reserved_slots` to interactive ones."""
        reserved = min(self.settings.interactive_reserved_slots, self.profile.slots - 1)
        batch_used = sum(r.sequences for r in self.running.values() if r.job_class == "batch")
        return max(0, min(free, self.profile.slots - reserved - batch_used))

    @property
    def newcomer_slots(self) -> int:
        """Slots this replica may take beyond its `slots` now, for callers with no job running here
        while others' jobs wait in waiting rooms (`NodeSettings.newcomer_slots`): the engine makes
        each such job a row by preempting a sequence of the caller holding the most
        (node_agent/engine/scheduler.Share), so one caller's flood does not make another's first job
        wait for a slot."""
        return max(
            0, min(self.settings.newcomer_slots, self.free_slots + self.settings.newcomer_slots)
        )

    def tenants(self) -> set[str]:
        """The callers with a job running here."""
        return {r.tenant for r in self.running.values() if r.tenant}

    def admit(self, job: str, running: Running) -> None:
        self.running[job] = running

    def fail(self, job: str, error: CortexError) -> None:
        """End a job held here with `error` (its client is told, its entry acknowledged, its slots freed)."""
        running = self.running.get(job)
        if running is not None:
            if running.trace is not None:
                running.trace.error = error.code
            charge = Charge(running.api_key, running.used) if running.api_key else None
            self.refuse(
                running.entry_id,
                running.channel,
                error,
                running.stream,
                job,
                running.streaming,
                charge if running.used is not None else None,
            )
            self.end(job)

    def fail_all(self, error: CortexError, jobs: list[str] = ()) -> None:
        """End every job held here, and `jobs` (out of the engine already) if still held, with `error`."""
        for job in set(jobs) | set(self.running):
            self.fail(job, error)

    def refuse(
        self,
        entry_id: str,
        channel: str,
        error: CortexError,
        stream: str = "",
        job: str = "",
        streaming: bool = False,
        charge: Charge | None = None,
    ) -> None:
        """Answer an entry with `error` and acknowledge it (an entry never admitted, or one that
        `fail` ends, with the `charge` of what it used when the ledger knows it)."""
        event = ErrorEvent(code=error.code, message=error.message)
        self._send(
            [
                Outgoing(
                    channel,
                    [event] if channel else [],
                    (stream or self.stream, entry_id),
                    job=job,
                    streaming=streaming,
                    charge=charge,
                )
            ],
            [],
        )

    def idle_past(self, keep_alive_s: float, now: int) -> bool:
        """No job held, and `keep_alive_s` (and every ended request's keep_alive) past (`keep_alive_s` < 0: never)."""
        keep_alive = keep_alive_s * 1000
        return (
            not self.running
            and keep_alive >= 0
            and now >= max(self.last_used_ms + keep_alive, self.keep_until_ms)
        )

    def end(self, job: str, timings: Timings | None = None) -> None:
        """The job ended (`timings`: its done event's, when it finished): its slots are free."""
        running = self.running.pop(job, None)
        if running is not None and running.trace is not None:
            running.trace.end(timings)
        self.last_used_ms = now_ms()
        if running is not None and running.keep_alive_s is not None:
            self.keep_until_ms = max(
                self.keep_until_ms, self.last_used_ms + keep_alive_ms(running.keep_alive_s)
            )
        self.slot_freed.set()
