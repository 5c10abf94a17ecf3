"""Every Redis key and channel name Cortex uses, built in one place.

`docs/redis.md` lists them with what `redis-cli` shows for each. The prefix is configurable
(`CORTEX_KEY_PREFIX`, default ``cortex:``) so several fleets can share one Redis.
"""

from dataclasses import dataclass

CONSUMER_GROUP = "agents"


@dataclass(frozen=True)
class Keys:
    prefix: str = "cortex:"

    def jobs(self, model: str) -> str:
        """Stream of queued jobs for one model (consumer group ``agents``)."""
        return f"{self.prefix}jobs:{model}"

    def events(self, job: str) -> str:
        """Pub/sub channel carrying one job's token events."""
        return f"{self.prefix}events:{job}"

    def cancel(self) -> str:
        """Pub/sub channel: a message is the id of a job to cancel; every node listens."""
        return f"{self.prefix}cancel"

    def result(self, job: str) -> str:
        """String with TTL: a job's final result, where someone must read it later."""
        return f"{self.prefix}result:{job}"

    def node(self, node: str) -> str:
        """Hash with TTL: one node's heartbeat."""
        return f"{self.prefix}node:{node}"

    def nodes(self) -> str:
        """Sorted set: node name -> last heartbeat (ms since the epoch)."""
        return f"{self.prefix}nodes"

    def cmd(self, node: str) -> str:
        """Stream of lifecycle commands for one node."""
        return f"{self.prefix}cmd:{node}"

    def catalog(self) -> str:
        """Hash: model id -> profile (JSON)."""
        return f"{self.prefix}catalog"

    def placement_lock(self, model: str) -> str:
        """String with PX: held by the gateway replica placing `model`."""
        return f"{self.prefix}lock:placement:{model}"

    def pins(self) -> str:
        """Hash: model id -> "1" (pinned) / "0" (unpinned), set at run time over the catalogue's `pin`."""
        return f"{self.prefix}pins"

    def janitor_lock(self) -> str:
        """String with PX: held by the gateway replica running the fleet janitor this round."""
        return f"{self.prefix}lock:janitor"

    def all_pattern(self) -> str:
        return f"{self.prefix}*"
