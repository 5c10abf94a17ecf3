"""The messages between a node and a model's output process (node_agent/serving/output_process.py),
length-prefixed msgpack over a socket pair: the node writes `Open` (the settings and the model's
tokenizer), each engine step's record (`Step`, the engine's `StepOutput`, written by the device
thread itself) and what it has to say about a job itself (`Publish`: `Outgoing` events with the
job's `Delivery`, a failure, a cancel); the process answers with `Feedback`. `Outgoing` and its
`Charge` are also what the process hands its publisher (node_agent/serving/publisher.py)."""

import struct

import msgspec

from node_agent.engine.records import StepOutput
from shared.wire import Event, Timings, Usage


class Charge(msgspec.Struct, array_like=True):
    """What an ended job used, to count against the API key that sent it (shared/usage_meter.py)."""

    api_key: str  # its name
    usage: Usage


class Outgoing(msgspec.Struct, array_like=True, omit_defaults=True):
    """One job's events of one step (a Struct: the node hands these to its output process)."""

    channel: str
    events: list[Event]  # in order
    ack: tuple[str, str] | None = None  # (stream, entry id) to XACK + XDEL after publishing
    job: str = ""
    started: bool = (
        False  # a streaming job's first output: noted in `Keys.started` (before it is published)
    )
    streaming: bool = False  # a streaming job whose note is dropped when it ends (with `ack`)
    charge: Charge | None = None  # with `ack`: the job's tokens, counted in the same round trip


FRAME = struct.Struct("<I")  # each message: its length, then its msgpack bytes


class Delivery(msgspec.Struct, array_like=True):
    """Where a job's events go and which stream entry its end acknowledges."""

    job: str
    channel: str
    stream: str
    entry_id: str
    streaming: bool = False  # a client streams it: its first output is noted in `Keys.started`
    started: bool = False
    api_key: str = ""  # the API key its tokens count against where it ends (none: unmetered)


class Open(msgspec.Struct, tag=True, array_like=True):
    redis_url: str
    key_prefix: str
    node: str
    model: str
    log_level: str
    tokenizer: bytes  # the model's tokenizer, `TokenizerText.dumps`
    stream_retention_s: int = 600  # how long a job's event log lives after it ends
    max_event_bytes: int = 64 << 10  # larger events go to the job's `Keys.result` (the publisher)
    whole_flush_s: float = 1.0  # a job not streamed: its deltas go joined at most this often
    heartbeat_ttl_s: float = (
        8.0  # what the cache's prefix marks (`Keys.prefixes`) live without a renewal
    )


class Publish(msgspec.Struct, tag=True, array_like=True):
    items: list[Outgoing]  # an item that acknowledges a job ends it here too
    deliveries: list[Delivery] = []  # jobs the engine will run


class Step(msgspec.Struct, tag=True, array_like=True):
    out: StepOutput


Message = Open | Publish | Step


class Feedback(msgspec.Struct, array_like=True, omit_defaults=True):
    stopped: list[int] = []  # sequence keys a stop string ended (or whose job's text side failed)
    ended: list[str] = []  # jobs whose last events (and acknowledgement) went to the publisher
    unheard: list[str] = []  # jobs nobody listens to any more
    lost: list[str] = []  # running jobs whose events Redis did not take
    timings: dict[
        str, Timings
    ] = {}  # of the `ended` jobs that finished: their done event's (the node's spans)
