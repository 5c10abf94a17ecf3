"""`cortex batch-worker`: an arq worker that runs batches. arq only orchestrates: `run_batch`
runs one batch (its lines go to the job streams as `batch`-class jobs), and the `resume_batches`
cron task re-enqueues active batches whose lease expired (their worker died), so a batch survives
a restart of any worker or gateway, or of Redis: when arq loses Redis for longer than its client's
retries, the worker stops its batches and starts arq again until Redis answers (`serve`). Start as
many workers as you like: the lease keeps one worker per batch."""

import asyncio
import contextlib
import dataclasses
import logging
import signal
from functools import partial

from arq import cron
from arq.connections import RedisSettings
from arq.worker import Worker, func
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.batch.runner import BatchRunner, LeaseLost
from gateway.bus.links import pubsub_client
from gateway.bus.router import EventRouter
from gateway.jobs.context import JobContext
from gateway.stores.batches import enqueue
from shared import __version__
from shared.catalog import Catalog
from shared.fleet import Fleet
from shared.redis_conn import BACKOFF_MAX_S, Outage, connect, redact
from shared.redis_health import warn_if_not_durable
from shared.settings import BatchSettings

log = logging.getLogger(__name__)

RUN_BATCH_TIMEOUT_S = 25 * 3600  # the 24 h completion window, and then some


async def run_batch(ctx: dict, batch_id: str) -> None:
    try:
        await BatchRunner(ctx["cortex"], ctx["settings"], batch_id).run()
    except LeaseLost as exc:
        log.warning("%s; leaving the batch to it", exc)
    except (RedisError, OSError) as exc:
        log.warning(
            "batch %s stopped: Redis failed (%s); it resumes from what Redis holds once Redis answers and "
            "its lease expires",
            batch_id,
            exc,
        )


class QuietCron(logging.Filter):
    """arq logs two INFO lines for every task it runs; for `resume_batches`, every few seconds, that is
    ~35,000 lines a day of nothing. They are dropped: `resume_batches` says when it resumes a batch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno >= logging.WARNING
            or f"cron:{resume_batches.__name__}" not in record.getMessage()
        )


async def resume_batches(ctx: dict) -> None:
    """Enqueue every active batch that nobody holds the lease of."""
    cortex: JobContext = ctx["cortex"]
    for batch_id in await cortex.batches.active():
        if not await cortex.redis.exists(cortex.keys.batch_lease(batch_id)):
            log.info("batch %s has no worker; resuming it", batch_id)
            # on arq's queue, through arq's own connection
            await enqueue(ctx["redis"], cortex.keys, batch_id)


async def startup(ctx: dict, settings: BatchSettings) -> None:
    keys = settings.keys
    redis = connect(settings.redis_url)
    bus = EventRouter(
        partial(pubsub_client, settings.redis_url), outage_wait_s=settings.redis_outage_wait_s
    )
    catalog = Catalog.load(settings.models_file)
    ctx["settings"] = settings
    ctx["cortex"] = JobContext(
        settings=settings,
        keys=keys,
        redis=redis,
        catalog=catalog,
        fleet=Fleet(redis, keys, settings.node_ttl_s),
        bus=bus,
    )
    await bus.start()
    log.info(
        "batch worker %s on Redis %s, queue %s on %s",
        __version__,
        redact(settings.redis_url),
        keys.arq_queue(),
        redact(settings.batch_queue_url),
    )
    await warn_if_not_durable(redis, log)


async def shutdown(ctx: dict) -> None:
    cortex: JobContext | None = ctx.get("cortex")
    if cortex is not None:
        await cortex.bus.stop()
        await cortex.redis.aclose()


def arq_redis(url: str) -> RedisSettings:
    """arq's connection, retrying as `shared.redis_conn.connect` does: a short blip of Redis goes unnoticed."""
    return dataclasses.replace(
        RedisSettings.from_dsn(url),
        retry=Retry(ExponentialBackoff(BACKOFF_MAX_S, 0.05), 5),
        retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
    )


def create_worker(settings: BatchSettings) -> Worker:
    every_s = min(max(settings.batch_resume_every_s, 1), 60)
    return Worker(
        functions=[func(run_batch, timeout=RUN_BATCH_TIMEOUT_S, max_tries=1000)],
        cron_jobs=[
            cron(
                resume_batches,
                second=set(range(0, 60, every_s)),
                run_at_startup=True,
                unique=True,
                timeout=60,
            )
        ],
        redis_settings=arq_redis(settings.batch_queue_url),
        queue_name=settings.keys.arq_queue(),
        on_startup=partial(startup, settings=settings),
        on_shutdown=shutdown,
        max_jobs=settings.batch_max_concurrent + 1,  # + the cron task
        poll_delay=settings.arq_poll_delay_s,
        keep_result=0,
        handle_signals=False,  # serve() handles them, also between two runs of arq
    )


async def serve(settings: BatchSettings) -> None:
    """Run the worker until SIGINT/SIGTERM; when Redis fails under arq, stop its batches (they resume
    once their leases expire) and start it again."""
    outage = Outage(log, "batch worker")
    stopping = asyncio.Event()
    current: list[Worker] = []

    def on_signal(signum: int) -> None:
        stopping.set()
        if current:
            current[0].handle_sig(signum)  # arq's own: cancels its tasks and its main loop

    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, on_signal, signum)
    while not stopping.is_set():
        current[:] = [worker := create_worker(settings)]
        try:
            await worker.async_run()
            return
        except asyncio.CancelledError:  # a signal: arq cancelled its main task
            return
        except (RedisError, OSError) as exc:
            outage.failed(exc)
        finally:
            await close(worker)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), 1)


async def close(worker: Worker) -> None:
    """arq's `Worker.close`, for a worker whose Redis may be gone: cancel its tasks, run our shutdown,
    close its pool."""
    for task in worker.tasks.values():
        task.cancel()
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    worker.tasks.clear()
    if "cortex" in worker.ctx:
        await shutdown(worker.ctx)
    pool = worker.ctx.get("redis")
    if pool is not None:
        try:
            await pool.delete(worker.health_check_key)
        except (RedisError, OSError):
            pass
        await pool.close(close_connection_pool=True)


def run(settings: BatchSettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("arq.worker").addFilter(QuietCron())
    asyncio.run(serve(settings))
