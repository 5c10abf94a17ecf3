"""What one model's KV cache on this node holds, as the gateways route by it: the hash
`Keys.prefixes(model, node)` of prefix marks (`shared.prefix_marks`) -> tokens they span. The
engine reports marks newly held and marks evicted with each step's record; this keeps the changes
until the publisher's next round trip writes them (HSET, HDEL, and the key's expiry, which the
node's heartbeats renew too); the first also deletes what an earlier engine of the model left. The
same marks go to the model's prefix index (`Keys.prefix_index`, as `{mark}@{node}`), from which a
gateway reads a job's marks on every candidate node in one HMGET (gateway routing). A round trip that fails leaves them here for the next one."""

from dataclasses import dataclass, field


@dataclass
class CacheIndex:
    key: str
    ttl_ms: int
    index_key: str = ""  # the model's prefix index (`Keys.prefix_index`): the same marks, by node
    node: str = ""  # whose marks: `{mark}@{node}` in the index
    _held: dict[str, int] = field(default_factory=dict)
    _dropped: set[str] = field(default_factory=set)
    _fresh: bool = True  # what the key holds is an older engine's: delete it first

    def note(self, held: list[tuple[str, int]], dropped: list[str]) -> None:
        """A step's changes (a mark held and dropped in one step ends dropped)."""
        for mark, tokens in held:
            self._held[mark] = tokens
            self._dropped.discard(mark)
        for mark in dropped:
            self._held.pop(mark, None)
            self._dropped.add(mark)

    def write(self, pipe) -> tuple[dict[str, int], set[str], bool] | None:
        """Queue the changes on `pipe`; returns them (to `restore` if the round trip fails), or None."""
        if not (self._held or self._dropped or self._fresh):
            return None
        held, dropped, fresh = self._held, self._dropped, self._fresh
        self._held, self._dropped, self._fresh = {}, set(), False
        if fresh:
            pipe.delete(self.key)
        if held:
            pipe.hset(self.key, mapping=held)
        if dropped:
            pipe.hdel(self.key, *dropped)
        pipe.pexpire(self.key, self.ttl_ms)
        if self.index_key:
            if held:
                pipe.hset(self.index_key, mapping={f"{m}@{self.node}": t for m, t in held.items()})
            if dropped:
                pipe.hdel(self.index_key, *(f"{m}@{self.node}" for m in dropped))
            pipe.pexpire(self.index_key, self.ttl_ms)
        return held, dropped, fresh

    def restore(self, written: tuple[dict[str, int], set[str], bool]) -> None:
        """Changes whose round trip failed go before those noted since."""
        held, dropped, fresh = written
        newer_held, newer_dropped = self._held, self._dropped
        self._held, self._dropped, self._fresh = held, dropped, fresh
        self.note(list(newer_held.items()), list(newer_dropped))
