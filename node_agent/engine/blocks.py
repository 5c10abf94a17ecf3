"""The KV block pool's bookkeeping: which blocks are free, which hold a cached prefix, who holds
what. Plain Python, no tensors: the blocks themselves live in the model side's paged cache
(node_agent/model/kv_cache.py), this only hands out their ids.

Block 0 is the null block: padding writes there and block tables are padded with it, so it is
never handed out. A full block is identified by a hash chain over the token ids it holds and every
block before it (`chain_hashes`), so two sequences that start with the same tokens name the same
hashes, block for block. A block nobody holds any more keeps its contents and its hash: it is
reused by the next sequence that asks for that hash, or evicted, least recently released first,
when a block is needed and no never-used block is left (vLLM's and SGLang's prefix caching).

A block may carry marks: the names the gateway gives a conversation's prefixes
(`shared.prefix_marks`), anchored on the block that ends them. A mark is held while one of its
blocks is cached; when the last is evicted it is `dropped`, and the node takes it out of what it
tells the gateways (`Keys.prefixes`). At most `2 * blocks` marks are kept, the oldest dropped first.

With KV tiers below the device (node_agent/engine/kv_tiers.py), an evicted block is first offered to
them (`spill`): a block they keep keeps its marks, whose tier changes (`retiered`: a mark's tier is
the best of its blocks', `device`, `host` or `disk`); they are dropped when no tier keeps it (`moved`).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK = 0
TIER_ORDER = ("device", "host", "disk")


def chain_hashes(tokens: list[int], block_size: int, parent: bytes, start: int = 0) -> list[bytes]:
    """The hashes of the full blocks of `tokens` from block `start` on; `parent` is the hash of
    block `start - 1` (or the root: what else changes the cache's contents, such as its dtype)."""
    hashes = []
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashlib.blake2b(
            parent + array("q", tokens[begin : begin + block_size]).tobytes(), digest_size=16
        ).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """`blocks` usable blocks (ids 1..blocks) of `block_size` tokens each. With `caching` off, a
    released block forgets its contents at once."""

    def __init__(self, blocks: int, block_size: int, caching: bool = True):
        self.blocks, self.block_size, self.caching = blocks, block_size, caching
        self.refs = [0] * (blocks + 1)
        self.hash_of: list[bytes | None] = [None] * (blocks + 1)
        self.by_hash: dict[bytes, int] = {}
        self.empty: list[int] = list(
            range(blocks, 0, -1)
        )  # never used or forgotten: popped from the end
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # released, still cached: oldest first
        self.anchors: OrderedDict[str, set[bytes]] = (
            OrderedDict()
        )  # mark -> the block hashes it ends on, oldest first
        self.marks: dict[bytes, set[str]] = {}  # block hash -> the marks anchored on it
        self.dropped: list[str] = []  # marks no cached block holds any more, not yet taken
        # the tiers below the device: offered each evicted block, asked where a hash is kept
        self.spill: Callable[[int, bytes], None] | None = None
        self.below: Callable[[bytes], str | None] = lambda block_hash: None
        self.mark_tiers: dict[str, str] = {}  # each mark's tier, as last reported
        self.retiered: dict[str, str] = {}  # marks whose tier changed, not yet taken

    @property
    def free(self) -> int:
        """Blocks that can be handed out now (evicting cached ones if need be)."""
        return len(self.empty) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.blocks - self.free

    @property
    def cached(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self.evictable)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, held once each; the caller checked `free`."""
        if n > self.free:
            raise RuntimeError(f"asked for {n} blocks with {self.free} free")
        out = []
        for _ in range(n):
            if self.empty:
                block = self.empty.pop()
            else:
                block, _ = self.evictable.popitem(last=False)
                if self.spill is not None:
                    self.spill(block, self.hash_of[block])
                self._forget(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not yet held: see `hold`)."""
        found = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def hold(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks (from `match`) once more each."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Let go of a sequence's blocks. Its last blocks go first in the eviction order: a prefix
        is worth more than the tail that follows it."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.caching and self.hash_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self._forget(block)
                    self.empty.append(block)

    def register(self, block: int, block_hash: bytes) -> bool:
        """`block` is full and holds what `block_hash` names: later sequences may reuse it. A hash
        already cached in another block keeps that block (this one is then just held); False then."""
        if self.caching and block_hash not in self.by_hash and self.hash_of[block] is None:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash
            self._retier(block_hash)
            return True
        return False

    def _forget(self, block: int) -> None:
        """`block` no longer holds its hash (its marks stay while a tier below keeps it)."""
        if (block_hash := self.hash_of[block]) is not None:
            del self.by_hash[block_hash]
            self.hash_of[block] = None
            self.moved(block_hash)

    def moved(self, block_hash: bytes) -> None:
        """`block_hash` changed tier: the marks anchored on it follow, or let go of it when no tier
        keeps it any more."""
        if self.tier(block_hash) is not None:
            self._retier(block_hash)
            return
        for mark in self.marks.pop(block_hash, ()):
            self._unanchor(mark, block_hash)

    def tier(self, block_hash: bytes) -> str | None:
        return "device" if block_hash in self.by_hash else self.below(block_hash)

    def _retier(self, block_hash: bytes) -> None:
        """Note the marks on `block_hash` whose tier (their best block's) changed."""
        for mark in self.marks.get(block_hash, ()):
            tiers = [self.tier(h) for h in self.anchors[mark]]
            best = min((TIER_ORDER.index(t) for t in tiers if t), default=len(TIER_ORDER) - 1)
            if self.mark_tiers.get(mark) != TIER_ORDER[best]:
                self.mark_tiers[mark] = self.retiered[mark] = TIER_ORDER[best]

    # ---- marks ------------------------------------------------------------------------------

    def mark(self, block_hash: bytes, mark: str) -> bool:
        """Anchor `mark` on the cached block named `block_hash`; True if the mark is new (no cached
        block held it). A hash no block holds (caching off, or evicted already) anchors nothing."""
        if block_hash not in self.by_hash:
            return False
        self.mark_tiers.setdefault(mark, "device")
        anchors = self.anchors.get(mark)
        new = anchors is None
        if new:
            anchors = self.anchors[mark] = set()
            while len(self.anchors) > 2 * self.blocks:
                oldest = next(iter(self.anchors))
                for held in list(self.anchors[oldest]):
                    self.marks[held].discard(oldest)
                    self._unanchor(oldest, held)
        else:
            self.anchors.move_to_end(mark)
        anchors.add(block_hash)
        self.marks.setdefault(block_hash, set()).add(mark)
        self._retier(block_hash)  # a mark held below comes back to the device
        return new

    def _unanchor(self, mark: str, block_hash: bytes) -> None:
        anchors = self.anchors[mark]
        anchors.discard(block_hash)
        if not anchors:
            del self.anchors[mark]
            self.mark_tiers.pop(mark, None)
            self.retiered.pop(mark, None)
            self.dropped.append(mark)

    def take_dropped(self) -> list[str]:
        """The marks dropped since the last call."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def take_retiered(self) -> list[tuple[str, str]]:
        """(mark, tier) of the marks whose tier changed since the last call."""
        retiered, self.retiered = self.retiered, {}
        return list(retiered.items())

    def reset(self) -> None:
        """Forget everything (after a device fault the cache's contents are not to be trusted)."""
        dropped = self.dropped + list(self.anchors)
        spill, below = self.spill, self.below
        self.__init__(self.blocks, self.block_size, self.caching)
        self.dropped, self.spill, self.below = dropped, spill, below
