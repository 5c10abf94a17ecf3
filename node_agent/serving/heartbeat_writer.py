"""A node's heartbeat into Redis, sized by what changed. The node builds the whole heartbeat each
time (node_agent/serving/agent.py `_beat`, the one builder real and simulated nodes share); this
writes the hash fields that differ from the last beat Redis took, and, when any did, appends them
to the fleet's change stream (`Keys.fleet_changes`) with the node's `seq`, the count of such beats,
from which gateways keep their fleet view (shared/fleet_view.py). A beat that changed nothing is
`heartbeat_ms` alone, the hash's expiry and the node's score in `Keys.nodes`. Every field is
written at the first beat, after a beat that found the hash gone (a Redis that lost it), and when
the last beat Redis took is older than half the hash's TTL (a late beat: the hash may be gone)."""

from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys

CHANGES_KEPT = 10_000  # MAXLEN ~ of the change stream: a gateway behind by more reads the hashes


class HeartbeatWriter:
    def __init__(self, keys: Keys, node: str, ttl_ms: int):
        self.keys, self.node, self.ttl_ms = keys, node, ttl_ms
        self.seq = 0
        self._sent: dict[str, str] = {}  # what the hash holds, as far as this node knows
        self._writing: dict[str, str] = {}
        self._whole = False
        self._written_ms = self._writing_ms = 0  # the last beat Redis took, and this one

    def write(self, pipe, beat: NodeHeartbeat) -> None:
        """Queue the beat on `pipe`, first (`settle` reads the first reply)."""
        if beat.heartbeat_ms - self._written_ms > self.ttl_ms // 2:
            self._sent = {}  # late (a busy host): the hash may have expired, write all of it
        fields = beat.to_hash()
        changed = {
            k: v
            for k, v in fields.items()
            if k not in ("heartbeat_ms", "seq") and self._sent.get(k) != v
        }
        if changed:
            self.seq += 1
            changed["seq"] = str(self.seq)
        key = self.keys.node(self.node)
        pipe.pexpire(key, self.ttl_ms)  # 0: the hash is gone, and this beat may not be all of it
        pipe.hset(key, mapping={**changed, "heartbeat_ms": fields["heartbeat_ms"]})
        pipe.zadd(self.keys.nodes(), {self.node: beat.heartbeat_ms})
        if changed:
            pipe.xadd(
                self.keys.fleet_changes(),
                {"node": self.node, "started_ms": fields["started_ms"], **changed},
                maxlen=CHANGES_KEPT,
                approximate=True,
            )
        self._writing = fields | {"seq": str(self.seq)}
        self._writing_ms = beat.heartbeat_ms
        self._whole = not self._sent  # every field sent: right even if the hash was gone

    def settle(self, replies: list) -> None:
        """After the pipeline ran: what the hash holds now (or, if it was gone, send it all next)."""
        self._sent = self._writing if replies[0] or self._whole else {}
        self._written_ms = self._writing_ms

    def forget(self) -> None:
        """Send every field next time (the hash may be gone: Redis restarted)."""
        self._sent = {}
