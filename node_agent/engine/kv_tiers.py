"""The KV tiers below the device pool, as the scheduler sees them: which full blocks, named by the
prefix cache's hash chain (node_agent/engine/blocks.py), are kept in host memory and on disk, and the
copies a step must make between the tiers. Plain Python, no tensors: the copies themselves are the
runner's (node_agent/model/kv_host.py), listed in the step's plan.

- **Host memory** (`kv_host_mb` in the catalogue): a cached block the device pool evicts is offered
  here (`spill`) and copied into a host slot at the start of the step that reuses its device block;
  the slots are evicted least recently used. A prompt whose prefix continues in host memory gets
  device blocks for it, copied back (`StepPlan.restores`) instead of recomputed.
- **Disk** (`kv_disk_dir`, node_agent/engine/kv_disk.py): every full block computed is written once,
  content-addressed, so a node restarted on the same host finds its prefixes there; a prefix that
  continues on disk is read back (`StepPlan.loads`), checked first.

A copy costs far less than computing the block: a step restores up to `RESTORE_RATIO` times its
prefill budget in tokens (always at least one sequence's prefix), and what it restores takes
1 / `RESTORE_RATIO` of that budget from the prefill chunks of the same step.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.engine.kv_disk import DiskTier

RESTORE_RATIO = 8
DEVICE, HOST, DISK = "device", "host", "disk"


@dataclass
class Below:
    """A block of a prompt's prefix found below the device pool: in host `slot`, else on disk
    (`payload` once read and checked)."""

    block_hash: bytes
    slot: int | None = None
    payload: bytes | None = None


@dataclass
class TierStats:
    """Counters from the engine's start: prompt tokens found in each tier below the device (at a
    sequence's first admission, as the prefix cache's hits), and the bytes moved between the tiers
    (a preempted sequence's restores too)."""

    host_hits: int = 0
    disk_hits: int = 0
    offloaded_bytes: int = 0  # device -> host
    restored_bytes: int = 0  # host -> device
    disk_written_bytes: int = 0
    disk_read_bytes: int = 0


class HostTier:
    """`slots` host blocks: which hash each holds, least recently used first."""

    def __init__(self, slots: int):
        self.slots = slots
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.empty = list(range(slots - 1, -1, -1))
        self.busy: set[int] = set()  # slots the plan being built reads: never evicted under it

    @property
    def used(self) -> int:
        return len(self.slot_of)

    def take(self, block_hash: bytes) -> tuple[int | None, bytes | None]:
        """A slot for `block_hash` (None when every slot is busy), and the hash it evicted."""
        if self.empty:
            return self.empty.pop(), None
        for old, slot in self.slot_of.items():
            if slot not in self.busy:
                del self.slot_of[old]
                return slot, old
        return None, None

    def reset(self) -> None:
        self.__init__(self.slots)


class KVTiers:
    """The host and disk tiers of one engine (either may be off). `block_bytes`: one block's keys
    and values over every attention layer. `moved`: called with a hash that left a tier below (the
    block pool's marks anchored on it follow it, or let go of it)."""

    def __init__(self, host_slots: int, disk: DiskTier | None, block_bytes: int):
        self.host = HostTier(host_slots) if host_slots else None
        self.disk, self.block_bytes = disk, block_bytes
        self.stats = TierStats()
        self.moved: Callable[[bytes], None] = lambda block_hash: None
        self.offloads: list[tuple[int, int]] = []  # (device block, host slot) this step
        self.restored = 0  # tokens restored this step

    def begin(self) -> None:
        """A new step's plan: nothing planned yet."""
        self.offloads, self.restored = [], 0
        if self.host:
            self.host.busy.clear()

    def where(self, block_hash: bytes) -> str | None:
        """The tier below the device that keeps `block_hash`, if any."""
        if self.host and block_hash in self.host.slot_of:
            return HOST
        if self.disk and self.disk.has(block_hash):
            return DISK
        return None

    def spill(self, block: int, block_hash: bytes) -> None:
        """The device pool evicts `block` (holding `block_hash`): keep a copy in host memory (the
        least recently used slot not read this step makes room)."""
        if self.host is None:
            return
        if block_hash in self.host.slot_of:  # restored from here earlier: the copy is still good
            self.host.slot_of.move_to_end(block_hash)
            return
        slot, evicted = self.host.take(block_hash)
        if evicted is not None:
            self.moved(evicted)
        if slot is not None:
            self.host.slot_of[block_hash] = slot
            self.host.busy.add(slot)  # written this step: not evicted under the copy
            self.offloads.append((block, slot))
            self.stats.offloaded_bytes += self.block_bytes

    def match(self, hashes: list[bytes]) -> list[Below]:
        """The blocks of the longest run of `hashes` kept below the device (each in host memory,
        else on disk); their host slots are not evicted by this step's plan."""
        found = []
        for block_hash in hashes:
            tier = self.where(block_hash)
            if tier is None:
                break
            slot = self.host.slot_of[block_hash] if tier == HOST else None
            if slot is not None:
                self.host.busy.add(slot)
            found.append(Below(block_hash, slot))
        return found

    def within_budget(self, found: list[Below], block_size: int, chunk_tokens: int) -> bool:
        """Whether this step may restore `found` too: the first sequence that restores always may."""
        tokens = len(found) * block_size
        return not self.restored or self.restored + tokens <= chunk_tokens * RESTORE_RATIO

    def read(self, found: list[Below]) -> list[Below]:
        """`found` up to its first block that cannot be had: the disk blocks read and checked (a
        corrupt, partial or foreign file ends it, with a log line)."""
        for i, below in enumerate(found):
            if below.slot is None:
                below.payload = self.disk.read(below.block_hash)
                if below.payload is None:
                    self.moved(below.block_hash)  # the disk let go of it
                    return found[:i]
                self.stats.disk_read_bytes += len(below.payload)
        return found

    def restore(self, found: list[Below], blocks: list[int], block_size: int) -> tuple[list, list]:
        """Plan the copies of `found` into device `blocks`: (host slot, block) restores and
        (payload, block) loads."""
        restores = [(b.slot, block) for b, block in zip(found, blocks) if b.slot is not None]
        loads = [(b.payload, block) for b, block in zip(found, blocks) if b.slot is None]
        for below in found:
            if below.slot is not None:
                self.host.slot_of.move_to_end(below.block_hash)
        self.restored += len(found) * block_size
        self.stats.restored_bytes += len(restores) * self.block_bytes
        return restores, loads

    def count(self, found: list[Below], block_size: int) -> None:
        """A first admission's prompt tokens found in each tier below (as `PrefixStats.hits`)."""
        host = sum(below.slot is not None for below in found)
        self.stats.host_hits += host * block_size
        self.stats.disk_hits += (len(found) - host) * block_size

    def keeps_on_disk(self, block_hash: bytes) -> bool:
        """Whether a newly computed block should be written to disk (not there yet); claims it."""
        if self.disk is None or not self.disk.claim(block_hash):
            return False
        self.stats.disk_written_bytes += self.block_bytes
        return True

    def write(self, saves: list[tuple[int, bytes]], payloads: list[bytes]) -> None:
        """The step's computed blocks' contents (in `saves` order), to disk in the background."""
        for (_, block_hash), payload in zip(saves, payloads):
            for dropped in self.disk.write(block_hash, payload):
                self.moved(dropped)

    def reset(self) -> None:
        """After a device fault: host copies may be half made; disk files are checked when read."""
        if self.host:
            self.host.reset()
        self.offloads, self.restored = [], 0

    def close(self) -> None:
        if self.disk:
            self.disk.close()
