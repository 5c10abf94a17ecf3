"""A model's output process: the per-token work of a node, away from the process that owns the
device (vLLM v1 detokenises in its front-end process for the same reason: one GIL).

The node (node_agent/serving/output_link.py) starts one per loaded model and writes it, over a
socket pair, length-prefixed msgpack `Message`s: its settings and the model's tokenizer first
(`Open`; node_agent/serving/output_messages.py has every message; nothing secret goes on the command line, which `ps` shows), each
engine step's record (`Step`, written by the device thread itself), and what the node itself has
to say about a job (`Publish`: its start event with the job's `Delivery`, a failure, a cancel). This
process detokenises, applies stop strings, builds and packs the wire events, and publishes them
with the acks of the jobs that end (node_agent/serving/publisher.py). A job whose client does not
stream gets its deltas joined: one delta at most every `whole_flush_s`, and one with its end (as
vLLM's front end does with `RequestOutputKind.FINAL_ONLY`): its client sees the whole answer only,
so per-token events would cost Redis, the gateway and this process for nothing. It answers with
`Feedback`: sequences its stop strings ended (the engine frees them, a step later at most), jobs that ended
(the node frees their slots), jobs nobody listens to or whose events Redis lost.

It exits when the node closes its end, after publishing what it holds. The node notices it dying
(the feedback socket closes) and treats it as a device fault: the model's jobs in flight fail and
the model is reloaded.

    python -m node_agent.serving.output_process INBOX_FD FEEDBACK_FD
"""

import asyncio
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import redis.asyncio as aioredis

from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.output import OutputProcessor
from node_agent.engine.records import StepOutput
from node_agent.serving.cache_index import CacheIndex
from node_agent.serving.output_messages import (
    FRAME,
    Charge,
    Delivery,
    Feedback,
    Message,
    Open,
    Outgoing,
    Publish,
    Step,
)
from node_agent.serving.publisher import Publisher
from shared.keys import Keys
from shared.redis_conn import connect, is_cluster_url
from shared.wire import DoneEvent, Event, ends_job, joined_deltas

log = logging.getLogger(__name__)


def frame(message: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> bytes:
    data = encoder.encode(message)
    return FRAME.pack(len(data)) + data


@dataclass
class OutputSide:
    """What the process does with each message: the text side of every job, and where its events go."""

    output: OutputProcessor
    publisher: Publisher
    send_feedback: Callable[["Feedback"], None]
    whole_flush_s: float = 1.0  # a job not streamed: its deltas are sent joined at most this often
    clock: Callable[[], float] = time.monotonic
    deliveries: dict[str, Delivery] = field(default_factory=dict)
    _held: dict[str, tuple[float, list[Event]]] = field(
        default_factory=dict
    )  # a job not streamed -> since when, its deltas not sent yet

    def handle(self, message: Message) -> None:
        if isinstance(message, Step):
            self.step(message.out)
        elif isinstance(message, Publish):
            self.publish(message)
        else:
            raise ValueError("the output process was opened twice")

    def step(self, out: StepOutput) -> None:
        if out.held or out.dropped or out.tiers:
            self.publisher.cache_index.note(out.held, out.dropped, out.tiers)
        events, stopped = self.output.process(out)
        batch, ended, timings, now = [], [], {}, self.clock()
        for job, job_events in events:
            if not (job_events := self._held_back(job, job_events, now)):
                continue
            if (item := self._outgoing(job, job_events)) is not None:
                batch.append(item)
                if item.ack:
                    ended.append(job)
                    if isinstance(job_events[-1], DoneEvent):
                        timings[job] = job_events[-1].timings
        self.publisher.send(batch)
        if stopped or ended:
            self.send_feedback(Feedback(stopped=stopped, ended=ended, timings=timings))

    def publish(self, message: Publish) -> None:
        for delivery in message.deliveries:
            self.deliveries[delivery.job] = delivery
        for item in message.items:
            if (
                item.ack and item.job
            ):  # the node ended it (failed, cancelled): no more events from the engine's side
                delivery = self.deliveries.pop(item.job, None)
                if (held := self._held.pop(item.job, None)) is not None and item.events:
                    item.events = joined_deltas(held[1] + item.events)
                used = self.output.drop(item.job)
                if delivery is not None and delivery.api_key and used is not None:
                    item.charge = Charge(delivery.api_key, used)
        self.publisher.send(message.items)

    def _held_back(self, job: str, events: list[Event], now: float) -> list[Event]:
        """What of a job's events of this step goes out now: all of a streamed job's; of a job not
        streamed, its deltas joined with those held back, once it ends or `whole_flush_s` after the
        first held back (nothing before)."""
        delivery = self.deliveries.get(job)
        if delivery is None or delivery.streaming:
            return events
        since, held = self._held.pop(job, (now, []))
        events = held + events
        if ends_job(events) or now - since >= self.whole_flush_s:
            return joined_deltas(events)
        self._held[job] = (since, events)
        return []

    def _outgoing(self, job: str, events: list[Event]) -> Outgoing | None:
        delivery = self.deliveries.get(job)
        if delivery is None:  # the node ended it already
            return None
        ended = ends_job(events)
        first = delivery.streaming and not delivery.started
        delivery.started = True
        charge = None
        if ended:
            del self.deliveries[job]
            used = self.output.consumed.get(job)
            charge = (
                Charge(delivery.api_key, used) if delivery.api_key and used is not None else None
            )
        return Outgoing(
            delivery.channel,
            events,
            (delivery.stream, delivery.entry_id) if ended else None,
            job,
            started=first,
            streaming=delivery.streaming,
            charge=charge,
        )


def open_side(
    opened: Open,
    text: TokenizerText,
    redis: aioredis.Redis,
    send_feedback: Callable[[Feedback], None],
) -> OutputSide:
    """The text side of `opened`'s model with its publisher started (on `redis`) and its prefix marks
    index: this process's, or, in a simulated node, the node's own (node_agent/sim/output.py)."""
    keys = Keys(opened.key_prefix, cluster=is_cluster_url(opened.redis_url))
    index = CacheIndex(
        keys.prefixes(opened.model, opened.node),
        int(opened.heartbeat_ttl_s * 1000),
        tiers_key=keys.prefix_tiers(opened.model, opened.node),
        index_key=keys.prefix_index(opened.model),
        node=opened.node,
    )
    publisher = Publisher(
        redis,
        keys,
        opened.node,
        on_unheard=lambda job: send_feedback(Feedback(unheard=[job])),
        on_lost=lambda job: send_feedback(Feedback(lost=[job])),
        retention_s=opened.stream_retention_s,
        max_event_bytes=opened.max_event_bytes,
        cache_index=index,
    )
    publisher.start()
    return OutputSide(
        OutputProcessor(text, opened.node), publisher, send_feedback, opened.whole_flush_s
    )


async def serve(inbox: socket.socket, feedback: socket.socket) -> None:
    reader, inbox_writer = await asyncio.open_unix_connection(
        sock=inbox
    )  # a writer dropped closes its socket
    _, writer = await asyncio.open_unix_connection(sock=feedback)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Message)

    async def receive() -> Message | None:
        try:
            (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            return decoder.decode(await reader.readexactly(size))
        except asyncio.IncompleteReadError:  # the node closed its end (or is gone)
            return None

    def send_feedback(message: Feedback) -> None:
        writer.write(frame(message, encoder))

    opened = await receive()
    if not isinstance(opened, Open):
        return
    logging.basicConfig(
        level=opened.log_level,
        format=f"%(asctime)s %(levelname)s output[{opened.model}] %(name)s: %(message)s",
    )
    redis = connect(opened.redis_url)
    side = open_side(opened, TokenizerText.loads(opened.tokenizer), redis, send_feedback)
    while (message := await receive()) is not None:
        try:
            side.handle(message)
        except (
            Exception
        ):  # a bug here must not pass silently; the node reloads the model when this exits
            log.exception("%s: the output process failed", opened.model)
            raise
    await side.publisher.stop()
    writer.close()
    inbox_writer.close()
    await redis.aclose()


def main(argv: list[str]) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a terminal's Ctrl-C is the node's to handle: it closes our inbox
    asyncio.run(serve(socket.socket(fileno=int(argv[0])), socket.socket(fileno=int(argv[1]))))


if __name__ == "__main__":
    main(sys.argv[1:])
