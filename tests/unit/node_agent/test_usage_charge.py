"""Tokens are counted against an API key where a job ends, on the node (shared/usage_meter.py): a
job that finishes, one the engine fails and one the node cancels each charge what they used, in
the round trip that acknowledges them, once; an unmetered job charges nobody. Against a real
redis-server, through the output process's side (`OutputSide`) and the publisher."""

import shutil

import pytest
import redis.asyncio as aioredis

from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.output import OutputProcessor
from node_agent.engine.records import JobFailed, JobOpened, StepOutput, TokenOut
from node_agent.serving.output_messages import Delivery, Outgoing, Publish
from node_agent.serving.output_process import OutputSide
from node_agent.serving.publisher import Publisher
from shared import usage_meter
from shared.api_keys import utc_day
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_conn import connect
from shared.wire import ErrorEvent, Usage

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
KEYS = Keys()
STREAM = KEYS.jobs("m")


class Letters:
    """A tokenizer's decode for the text side: token i is the i-th letter."""

    def decode(self, ids: list[int], **options) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


async def test_finished_failed_and_cancelled_jobs_charge_their_key_what_they_used_once(redis_url):
    admin = aioredis.Redis.from_url(redis_url)
    await admin.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    jobs = ["finished", "failed", "cancelled", "unmetered"]
    entries = {job: (await admin.xadd(STREAM, {"job": job})).decode() for job in jobs}
    await admin.xreadgroup(CONSUMER_GROUP, "node-a", {STREAM: ">"})
    publisher = Publisher(connect(redis_url), KEYS, "node-a", on_unheard=lambda job: None)
    publisher.start()
    side = OutputSide(
        OutputProcessor(TokenizerText(None, other=Letters()), "node-a"), publisher, lambda _: None
    )
    side.publish(
        Publish(
            items=[],
            deliveries=[
                Delivery(
                    job,
                    f"events:{job}",
                    STREAM,
                    entries[job],
                    api_key="" if job == "unmetered" else "alice",
                )
                for job in jobs
            ],
        )
    )
    side.step(
        StepOutput(
            time_ms=2,
            started_ms=1,
            opened=[
                JobOpened(job, [key], prompt_tokens=10 * (key + 1), submitted_ms=0)
                for key, job in enumerate(jobs)
            ],
            tokens=[TokenOut(key, 1) for key in range(4)],
        )
    )
    side.step(
        StepOutput(
            time_ms=3,
            started_ms=2,
            tokens=[
                TokenOut(0, 2, finish="length"),
                TokenOut(2, 2),
                TokenOut(3, 2, finish="length"),
            ],
            failed=[JobFailed("failed", "generation_failed", "the device faulted")],
        )
    )
    side.publish(
        Publish(
            items=[
                Outgoing(
                    "events:cancelled",
                    [ErrorEvent(code="cancelled", message="gone")],
                    (STREAM, entries["cancelled"]),
                    job="cancelled",
                )
            ]
        )
    )
    await publisher.flush()

    used = {
        "finished": 10 + 2,
        "failed": 20 + 1,
        "cancelled": 30 + 2,
    }  # prompt + tokens generated before the end
    record = await admin.hgetall(KEYS.api_key("alice"))
    assert (int(record[b"prompt_tokens"]), int(record[b"completion_tokens"])) == (60, 5)
    assert int(await admin.get(KEYS.daily_tokens("alice", utc_day()))) == sum(used.values())
    window = await admin.zrange(KEYS.rate_window("alice", "tokens"), 0, -1)
    assert sorted(window) == sorted(f"{job}:{tokens}".encode() for job, tokens in used.items())
    assert (await admin.xpending(STREAM, CONSUMER_GROUP))["pending"] == 0
    assert not await admin.exists(KEYS.api_key(""))

    again = admin.pipeline(
        transaction=False
    )  # the same job ended once more (run again after its node was lost)
    usage_meter.charge(
        again, KEYS, "alice", "finished", Usage(prompt_tokens=10, completion_tokens=2), 600
    )
    assert await again.execute() == [-1]
    assert int(await admin.get(KEYS.daily_tokens("alice", utc_day()))) == sum(used.values())
    await publisher.stop()
    await admin.aclose()
