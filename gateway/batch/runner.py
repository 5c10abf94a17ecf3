"""Runs one batch to its end: validating → in_progress → finalizing → completed (or failed,
cancelled, expired).

Every line's result is kept in Redis as soon as it exists (`cortex:batch:{id}:out` / `:err`,
by line number), so a batch resumed by another worker (or this one, restarted) skips finished
lines; a line whose job was queued or running when its worker died (`:inflight`) is withdrawn
and run again. Only the worker holding the batch's lease (`cortex:batch:{id}:lease`, renewed
while it runs) works on it. Inference stays on the job streams: a line is one `batch`-class job.

A line is admitted as every request is (gateway/jobs/submit.py `admit`): its key's tokens per
minute and per day count it. Over one of them the batch pauses (it stays `in_progress`, starts no
line and costs no try) until the key is admitted again, asking every `BUDGET_RECHECK_S` at most or
when the refusal's Retry-After says; a cancel or the completion window ends the pause, and the
lines still waiting go to the error file with the 429 they got. As the line that crosses a budget
finishes (every line already running does), a batch of a key with a token budget keeps no more
lines in flight than the budget left pays for, at the tokens its lines have cost so far (one
until a line has ended): its overshoot is a line or two, not `batch_lines_in_flight`.
"""

import asyncio
import contextlib
import logging
import time
import uuid

from redis.exceptions import RedisError

from gateway.batch import lines
from gateway.dialects.protocol.openai_batch import (
    Batch,
    BatchError,
    BatchErrors,
    BatchOutputLine,
    BatchRequestCounts,
)
from gateway.jobs.caller import ANONYMOUS_CALLER, Caller
from gateway.jobs.context import JobContext
from gateway.jobs.queue import withdraw
from shared.api_keys import ADMIN, ANONYMOUS, utc_day
from shared.errors import (
    BrokerUnavailable,
    CortexError,
    JobCancelled,
    ModelUnavailable,
    NodeLost,
    NotFound,
    RateLimited,
    Timeout,
)
from shared.redis_conn import atomic, publish
from shared.settings import BatchSettings

log = logging.getLogger(__name__)

RETRYABLE = (
    NodeLost,
    Timeout,
    ModelUnavailable,
)  # worth another try of the line (`batch_max_tries` in all)
RETRY_BACKOFF_S = (
    1.0,
    2.0,
    4.0,
    8.0,
)  # also while Redis is away or full, which costs a line no try
STATUS_POLL_S = 0.5  # how often a running batch looks for a cancel
BUDGET_RECHECK_S = 5.0  # a batch paused by its key's token budget asks to go on this often at most

_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


class LeaseLost(Exception):
    pass


class BatchRunner:
    def __init__(self, ctx: JobContext, settings: BatchSettings, batch_id: str):
        self.ctx, self.settings, self.id = ctx, settings, batch_id
        self.redis, self.keys = ctx.redis, ctx.keys
        self.store = ctx.batches
        self.files = ctx.files
        self.token = uuid.uuid4().hex
        self.stop_reason: str | None = None  # cancelled | expired
        self.owner = ANONYMOUS_CALLER  # the key the batch belongs to: its lines run as that key's
        self.running: dict[int, asyncio.Task] = {}
        self.broken: BaseException | None = (
            None  # a line failed on Redis (it cannot be recorded): the run stops
        )
        self.paused_until = 0.0  # monotonic: the key's token budget refused a line until then
        self.lines_ended = 0  # lines of this run that ended (their tokens are charged)
        self.tokens_spent = 0  # what the key's tokens today grew by while this run went on
        self.used_seen: int | None = None  # the key's tokens today when last read

    def key(self, what: str) -> str:
        return self.keys.batch_lines(self.id, what)

    # ---- the lease ------------------------------------------------------------------------

    async def acquire(self) -> bool:
        lease_ms = int(self.settings.batch_lease_s * 1000)
        return bool(
            await self.redis.set(self.keys.batch_lease(self.id), self.token, nx=True, px=lease_ms)
        )

    async def _keep_lease(self) -> None:
        lease_ms = int(self.settings.batch_lease_s * 1000)
        while True:
            await asyncio.sleep(self.settings.batch_lease_s / 3)
            try:
                renewed = await self.redis.eval(
                    _RENEW, 1, self.keys.batch_lease(self.id), self.token, lease_ms
                )
            except RedisError as exc:
                log.warning("batch %s: could not renew its lease: %s", self.id, exc)
                continue
            if not renewed:
                raise LeaseLost(f"batch {self.id}: another worker took its lease")

    async def release_lease(self) -> None:
        await self.redis.eval(_RELEASE, 1, self.keys.batch_lease(self.id), self.token)

    # ---- the run --------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the batch if nobody else does; returns when it is finished (or the lease is lost)."""
        if not await self.acquire():
            log.info("batch %s is leased by another worker", self.id)
            return
        keeper = asyncio.create_task(self._keep_lease(), name=f"lease-{self.id}")
        work = asyncio.create_task(self._run(), name=f"batch-{self.id}")
        try:
            await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
            if keeper.done():
                keeper.result()  # raises LeaseLost
            work.result()
        finally:
            for task in (work, keeper):
                task.cancel()
            await asyncio.gather(work, keeper, return_exceptions=True)
            with contextlib.suppress(RedisError, OSError):  # else the lease expires by itself
                await self.release_lease()

    async def _run(self) -> None:
        try:
            batch = await self.store.get(self.id)
        except NotFound:
            await self.redis.srem(self.keys.batches_active(), self.id)
            return
        await self._read_owner()
        if batch.status == "validating":
            batch = await self._validate(batch)
        if batch.status in ("in_progress", "cancelling"):
            content = await self._input(batch)
            if content is None:
                return
            await self._run_lines(batch, content)
            batch = await self.store.get(self.id)
        if batch.status in ("in_progress", "cancelling", "finalizing"):
            await self._finalize(batch)

    async def _read_owner(self) -> None:
        """The batch's key, read again while the batch runs: a line of a key revoked since fails."""
        name = await self.store.owner(self.id)
        self.owner = Caller(
            name, await self.ctx.api_keys.get(name) if name not in (ADMIN, ANONYMOUS) else None
        )

    async def _input(self, batch: Batch) -> list[bytes] | None:
        try:
            content = await self.files.content(batch.input_file_id)
        except NotFound:
            await self._fail(
                f"the input file {batch.input_file_id} no longer exists", "file_not_found"
            )
            return None
        return [line for line in content.splitlines() if line.strip()]

    async def _validate(self, batch: Batch) -> Batch:
        content = await self._input(batch)
        if content is None:
            return await self.store.get(self.id)
        if len(content) > self.settings.files_max_lines:
            await self._fail(
                f"the input file has {len(content)} lines; the limit is {self.settings.files_max_lines}",
                "too_many_lines",
            )
            return await self.store.get(self.id)
        await self.store.update(
            self.id, request_counts=BatchRequestCounts(total=len(content)).model_dump()
        )
        await self.store.transition(
            self.id, "in_progress", from_=("validating",), stamp="in_progress_at"
        )
        log.info("batch %s: %d lines, in progress", self.id, len(content))
        return await self.store.get(self.id)

    async def _fail(self, message: str, code: str) -> None:
        errors = BatchErrors(data=[BatchError(code=code, message=message)])
        await self.store.update(self.id, errors=errors.model_dump())
        await self.store.transition(
            self.id, "failed", from_=("validating", "in_progress", "cancelling"), stamp="failed_at"
        )
        log.warning("batch %s failed: %s", self.id, message)

    async def _run_lines(self, batch: Batch, content: list[bytes]) -> None:
        await self._withdraw_leftovers()
        if batch.status == "cancelling":
            self.stop_reason = "cancelled"
        done = {int(i) for i in await self.redis.hkeys(self.key("out"))}
        done |= {int(i) for i in await self.redis.hkeys(self.key("err"))}
        todo = [i for i in range(len(content)) if i not in done]
        log.info("batch %s: %d of %d lines to run", self.id, len(todo), len(content))
        watcher = asyncio.create_task(self._watch(batch), name=f"watch-{self.id}")
        try:
            for line_no in todo:
                while len(self.running) >= await self._in_flight_cap() and not self.stop_reason:
                    await asyncio.wait(
                        set(self.running.values()),
                        timeout=STATUS_POLL_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    self._check_broken()
                await self._while_paused()
                if self.stop_reason:
                    break
                task = asyncio.create_task(self._line(line_no, content[line_no], batch.endpoint))
                self.running[line_no] = task
                task.add_done_callback(lambda t, n=line_no: self._line_done(n, t))
            while self.running:
                await asyncio.wait(set(self.running.values()))
                self._check_broken()
        finally:
            for task in self.running.values():
                task.cancel()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _in_flight_cap(self) -> int:
        """Lines that may be queued or running at once: `batch_lines_in_flight`, or for a key with a
        token budget what the budget left pays for at this run's tokens per line so far (what the
        key's count of today's tokens grew by while it ran, over the lines ended), at least one."""
        cap, key = self.settings.batch_lines_in_flight, self.owner.key
        if key is None or not (key.tpm or key.max_tokens_per_day):
            return cap
        try:
            used = int(await self.redis.get(self.keys.daily_tokens(key.name, utc_day())) or 0)
        except RedisError:  # the line's own start will wait for Redis
            return 1
        if self.used_seen is not None and used > self.used_seen:
            self.tokens_spent += used - self.used_seen
        self.used_seen = used  # lower: a new day
        if not (self.lines_ended and self.tokens_spent):
            return 1
        per_line = max(1, self.tokens_spent // self.lines_ended)
        left = [key.tpm] if key.tpm else []
        if key.max_tokens_per_day:
            left.append(key.max_tokens_per_day - used)
        return max(1, min(cap, min(left) // per_line))

    def _pause(self, refusal: RateLimited) -> None:
        """The key is over a token budget: no line starts until its Retry-After (or the next
        recheck, whichever is sooner)."""
        resume = time.monotonic() + min(refusal.retry_after, BUDGET_RECHECK_S)
        if self.paused_until <= time.monotonic():
            log.info("batch %s paused: %s", self.id, refusal.message)
        self.paused_until = max(self.paused_until, resume)

    async def _while_paused(self) -> None:
        while time.monotonic() < self.paused_until and not self.stop_reason:
            await asyncio.sleep(min(STATUS_POLL_S, self.paused_until - time.monotonic()))

    def _line_done(self, line_no: int, task: asyncio.Task) -> None:
        self.running.pop(line_no, None)
        self.lines_ended += 1
        if not task.cancelled() and task.exception() is not None and self.broken is None:
            self.broken = task.exception()

    def _check_broken(self) -> None:
        """A line that could not be recorded (Redis failed) stops the run: the batch resumes, from what
        Redis holds, once its lease expires."""
        if self.broken is not None:
            raise self.broken

    async def _watch(self, batch: Batch) -> None:
        """Notice a cancel (or the completion window closing): start no more lines, and take back
        the lines still waiting on the streams; lines a node already runs finish."""
        while self.stop_reason is None:
            await asyncio.sleep(STATUS_POLL_S)
            try:
                await self._read_owner()
                status = (await self.store.get(self.id)).status
            except (RedisError, OSError):  # Redis away: look again next time
                continue
            if status == "cancelling":
                self.stop_reason = "cancelled"
            elif batch.expires_at and time.time() > batch.expires_at:
                self.stop_reason = "expired"
        log.info("batch %s: %s; %d lines in flight", self.id, self.stop_reason, len(self.running))
        await self._withdraw_queued()

    async def _withdraw_queued(self) -> None:
        for line_no, where in (await self.redis.hgetall(self.key("inflight"))).items():
            _job, stream, entry_id = where.decode().split(" ")
            if await withdraw(self.redis, self.keys, stream, entry_id):
                task = self.running.get(int(line_no))
                if task is not None:
                    task.cancel()
                await self.redis.hdel(self.key("inflight"), line_no)

    async def _withdraw_leftovers(self) -> None:
        """Lines a previous run had on the streams: withdraw those still queued and cancel the
        rest (their events went to a worker that is gone); they run again."""
        leftovers = await self.redis.hgetall(self.key("inflight"))
        for line_no, where in leftovers.items():
            job, stream, entry_id = where.decode().split(" ")
            await withdraw(self.redis, self.keys, stream, entry_id)
            await publish(self.redis, self.keys.cancel(), job)
        if leftovers:
            log.info(
                "batch %s: %d lines were in flight in an earlier run; running them again",
                self.id,
                len(leftovers),
            )
            await self.redis.delete(self.key("inflight"))

    async def _line(self, line_no: int, raw: bytes, endpoint: str) -> None:
        custom_id, job_id = None, ""
        try:
            parsed = lines.parse_line(raw, endpoint)
            custom_id = parsed.custom_id
            result = await self._attempts(line_no, parsed, endpoint)
        except lines.LineError as exc:
            await self._record(line_no, "err", lines.failed_line(line_no, exc, custom_id))
        except CortexError as exc:
            job_id = getattr(exc, "job_id", "")
            await self._record(line_no, "err", lines.failed_line(line_no, exc, custom_id, job_id))
        else:
            await self._record(line_no, "out", result)

    async def _attempts(
        self, line_no: int, parsed: lines.ParsedLine, endpoint: str
    ) -> BatchOutputLine:
        tries, waits = 0, 0
        while True:
            job = None
            try:
                job = await lines.start(self.ctx, parsed, self.owner, endpoint)
                await self.redis.hincrby(self.key("tries"), str(line_no), 1)
                await self.redis.hset(
                    self.key("inflight"), str(line_no), f"{job.id} {job.stream} {job.entry_id}"
                )
                return await lines.finish(job, parsed, endpoint)
            except RateLimited as exc:  # over a token budget: the batch pauses, costs no try
                if not self.stop_reason:
                    self._pause(exc)
                    await self._while_paused()
                if self.stop_reason:  # cancelled or expired meanwhile: the line ends with its 429
                    raise
            except (
                BrokerUnavailable
            ) as exc:  # Redis away (or full): not the line's fault, it costs no try
                if self.stop_reason:
                    exc.job_id = job.id if job else ""
                    raise
                await asyncio.sleep(RETRY_BACKOFF_S[min(waits, len(RETRY_BACKOFF_S) - 1)])
                waits += 1
            except RETRYABLE as exc:
                tries += 1
                if tries >= self.settings.batch_max_tries or self.stop_reason:
                    exc.job_id = job.id if job else ""
                    raise
                log.info("batch %s line %d: %s; trying again", self.id, line_no, exc.message)
                await asyncio.sleep(RETRY_BACKOFF_S[min(tries - 1, len(RETRY_BACKOFF_S) - 1)])
            except (CortexError, JobCancelled) as exc:
                exc.job_id = job.id if job else ""
                raise

    async def _record(self, line_no: int, kind: str, line: BatchOutputLine) -> None:
        async with atomic(self.redis) as pipe:
            pipe.hset(self.key(kind), str(line_no), line.model_dump_json())
            pipe.hdel(self.key("inflight"), str(line_no))
            pipe.hlen(self.key("out"))
            pipe.hlen(self.key("err"))
            *_, completed, failed = await pipe.execute()
        batch_key = self.keys.batch(self.id)
        counts = await self.redis.hget(batch_key, "request_counts")
        total = BatchRequestCounts.model_validate_json(counts).total if counts else 0
        await self.store.update(
            self.id, request_counts={"total": total, "completed": completed, "failed": failed}
        )

    # ---- finishing ----------------------------------------------------------------------------

    async def _finalize(self, batch: Batch) -> None:
        ending = {"cancelling": "cancelled"}.get(batch.status, self.stop_reason or "completed")
        if batch.status != "finalizing":
            had = await self.store.transition(
                self.id, "finalizing", from_=(batch.status,), stamp="finalizing_at"
            )
            if had != batch.status:  # cancelled just now: finish as cancelled
                return await self._finalize(await self.store.get(self.id))
        out, completed = await self._lines("out")
        err, failed = await self._lines("err")
        total = (await self.store.get(self.id)).request_counts.total
        fields = {"request_counts": {"total": total, "completed": completed, "failed": failed}}
        if out:
            fields["output_file_id"] = (
                await self.files.create(
                    out,
                    filename=f"{self.id}_output.jsonl",
                    purpose="batch_output",
                    owner=self.owner.name,
                    quota_bytes=None,
                )
            ).id
        if err:
            fields["error_file_id"] = (
                await self.files.create(
                    err,
                    filename=f"{self.id}_error.jsonl",
                    purpose="batch_output",
                    owner=self.owner.name,
                    quota_bytes=None,
                )
            ).id
        await self.store.update(self.id, **fields)
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[
            ending
        ]
        await self.store.transition(self.id, ending, from_=("finalizing",), stamp=stamp)
        await self.redis.delete(*(self.key(k) for k in ("out", "err", "inflight", "tries")))
        log.info(
            "batch %s %s: %d output bytes, %d error bytes", self.id, ending, len(out), len(err)
        )

    async def _lines(self, kind: str) -> tuple[bytes, int]:
        """The file content of one kind of line, in input order, and how many lines it has."""
        by_line = await self.redis.hgetall(self.key(kind))
        ordered = [by_line[k] for k in sorted(by_line, key=int)]
        return b"".join(line + b"\n" for line in ordered), len(ordered)
