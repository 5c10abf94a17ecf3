"""A job's event log (`Keys.event_log`): a Redis Stream keeping what a job said, so that a client
that lost its connection can resume it through any gateway replica.

- The gateway creates it when it submits a resumable job (a streamed or a background one): the
  first entry has one field, `record` (JSON: what a gateway needs to render the job again, and the
  API key that owns it), and the stream expires `stream_retention_s + request_timeout_s` later
  unless a node takes the job first.
- The node appends one entry per engine step that has news for the job, pipelined with its PUBLISH
  (`append`): fields `0`, `1`, … each one packed event (`shared.wire`), in order. `NOMKSTREAM`: a
  job nobody can resume has no log and costs a no-op, and no log is ever made without an expiry.
  It sets the expiry to `stream_retention_s` when it first writes, again every half of that while
  the job runs, and once more when the job ends. `MAXLEN ~` caps it whatever happens.
- Entry ids order the events: a reader goes on after the last id it read (XREAD), so it gets no
  event twice. Each node entry also says where its events stand among the job's (field `at`: the
  events logged before it), so a reader that heard some events over pub/sub first takes up where
  they end, and one that finds events missing (entries a Redis lost in a failover or a restart
  from its file, after the node wrote them) knows it, rather than going on with a hole.
"""

from redis.asyncio.client import Pipeline

from shared.wire import Event, unpack_event

MAXLEN = (
    100_000  # entries (engine steps) kept at most; a job's steps are bounded by its context first
)
RECORD = b"record"  # the field of the gateway's first entry
_NAMES = tuple(str(i).encode() for i in range(16))


AT = b"at"  # the field of a node's entry: how many of the job's events the log held before it


def append(
    pipe: Pipeline, log: str, packed: list[bytes], expire_s: int | None, at: int | None = None
) -> None:
    """Queue on `pipe` one entry of packed events to an existing log, `at` their place among the
    job's events when the writer knows it (two replies: the entry id or None when there is no log,
    then the expiry's if `expire_s`)."""
    fields = {
        (_NAMES[i] if i < len(_NAMES) else str(i).encode()): event for i, event in enumerate(packed)
    }
    if at is not None:
        fields[AT] = str(at).encode()
    pipe.xadd(log, fields, maxlen=MAXLEN, approximate=True, nomkstream=True)
    if expire_s is not None:
        pipe.expire(log, expire_s)


def events(fields: dict[bytes, bytes]) -> list[Event]:
    """One entry's events, in order (none for the record)."""
    if RECORD in fields:
        return []
    return [unpack_event(fields[name]) for name in sorted(fields.keys() - {AT}, key=int)]


def place(fields: dict[bytes, bytes]) -> int | None:
    """Where the entry's events stand among the job's (`at`), or None where its writer did not say
    (the janitor's error for a job whose node died)."""
    return int(fields[AT]) if AT in fields else None
