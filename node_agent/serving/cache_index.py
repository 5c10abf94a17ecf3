"""What one model's KV cache on this node holds, as the gateways route by it: the hash
`Keys.prefixes(model, node)` of prefix marks (`shared.prefix_marks`) -> tokens they span, and beside
it `Keys.prefix_tiers(model, node)`: the marks kept only below the device (`host`, `disk`;
node_agent/engine/kv_tiers.py). The engine reports marks newly held, marks evicted and marks whose
tier changed with each step's record; this keeps the changes until the publisher's next round trip
writes them (HSET, HDEL, and the keys' expiry, which the node's heartbeats renew too); the first also
deletes what an earlier engine of the model left. The same marks go to the model's prefix index
(`Keys.prefix_index`, as `{mark}@{node}`, their tier in the value: `shared.prefix_marks.indexed`),
from which a gateway reads a job's marks on every candidate node in one HMGET (gateway routing). A round trip that fails leaves them here for the
next one."""

from dataclasses import dataclass, field

from shared.prefix_marks import DEVICE, indexed

Changes = tuple[dict[str, int], set[str], dict[str, str], bool]


@dataclass
class CacheIndex:
    key: str
    ttl_ms: int
    tiers_key: str = ""  # '' : tiers are not written
    index_key: str = ""  # the model's prefix index (`Keys.prefix_index`): the same marks, by node
    node: str = ""  # whose marks: `{mark}@{node}` in the index
    _held: dict[str, int] = field(default_factory=dict)
    _dropped: set[str] = field(default_factory=set)
    _tiers: dict[str, str] = field(default_factory=dict)  # mark -> its tier now
    _fresh: bool = True  # what the key holds is an older engine's: delete it first
    _spans: dict[str, int] = field(default_factory=dict)  # every mark held -> its tokens

    def note(
        self,
        held: list[tuple[str, int]],
        dropped: list[str],
        tiers: list[tuple[str, str]] = (),
    ) -> None:
        """A step's changes (a mark held and dropped in one step ends dropped; a mark newly held is
        on the device)."""
        for mark, tokens in held:
            self._held[mark] = tokens
            self._tiers[mark] = DEVICE
            self._dropped.discard(mark)
        for mark, tier in tiers:
            self._tiers[mark] = tier
        for mark in dropped:
            self._held.pop(mark, None)
            self._tiers.pop(mark, None)
            self._dropped.add(mark)

    def write(self, pipe) -> Changes | None:
        """Queue the changes on `pipe`; returns them (to `restore` if the round trip fails), or None."""
        if not (self._held or self._dropped or self._tiers or self._fresh):
            return None
        held, dropped, tiers, fresh = self._held, self._dropped, self._tiers, self._fresh
        self._held, self._dropped, self._tiers, self._fresh = {}, set(), {}, False
        keys = [self.key, self.tiers_key] if self.tiers_key else [self.key]
        for key in keys if fresh else ():  # one by one: on a cluster the two hash to two slots
            pipe.delete(key)
        if held:
            pipe.hset(self.key, mapping=held)
        if dropped:
            pipe.hdel(self.key, *dropped)
        if self.tiers_key:
            below = {mark: tier for mark, tier in tiers.items() if tier != DEVICE}
            if below:
                pipe.hset(self.tiers_key, mapping=below)
            if on_device := [m for m, tier in tiers.items() if tier == DEVICE] + list(dropped):
                pipe.hdel(self.tiers_key, *on_device)
        for key in keys:
            pipe.pexpire(key, self.ttl_ms)
        if self.index_key:
            self._spans.update(held)
            for mark in dropped:
                self._spans.pop(mark, None)
            values = {
                f"{mark}@{self.node}": indexed(self._spans[mark], tiers.get(mark, DEVICE))
                for mark in held.keys() | tiers.keys()
                if mark in self._spans
            }
            if values:
                pipe.hset(self.index_key, mapping=values)
            if dropped:
                pipe.hdel(self.index_key, *(f"{m}@{self.node}" for m in dropped))
            pipe.pexpire(self.index_key, self.ttl_ms)
        return held, dropped, tiers, fresh

    def restore(self, written: Changes) -> None:
        """Changes whose round trip failed go before those noted since."""
        held, dropped, tiers, fresh = written
        newer = self._held, self._dropped, self._tiers
        self._held, self._dropped, self._tiers, self._fresh = held, dropped, tiers, fresh
        self.note(list(newer[0].items()), list(newer[1]), list(newer[2].items()))
