"""Which LoRA adapter each of a replica's device slots holds (node_agent/model/lora_layers.py),
for the scheduler: a sequence of an adapter takes that adapter's slot when admitted, loading it
into a free slot, else into the least recently used slot no running sequence uses; with none,
the sequence waits (as for blocks). Slot 0 is the base and is never handed out."""

from collections import OrderedDict


class AdapterSlots:
    def __init__(self, slots: int):
        self.slots = slots
        self.held: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recent first
        self.users = [0] * (slots + 1)  # running sequences on each slot

    def acquire(self, adapter: str) -> tuple[int, bool] | None:
        """The adapter's slot for one more sequence, and whether it must be loaded there first;
        None when every slot holds an adapter some running sequence uses."""
        slot = self.held.get(adapter)
        fresh = slot is None
        if fresh:
            taken = set(self.held.values())
            slot = next((s for s in range(1, self.slots + 1) if s not in taken), None)
            if slot is None:
                idle = next((a for a, s in self.held.items() if not self.users[s]), None)
                if idle is None:
                    return None
                slot = self.held.pop(idle)
            self.held[adapter] = slot
        self.held.move_to_end(adapter)
        self.users[slot] += 1
        return slot, fresh

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def forget(self, adapter: str) -> None:
        """The adapter was unloaded: its slot is free once no sequence uses it (its sequences
        running now finish on it)."""
        slot = self.held.get(adapter)
        if slot is not None and not self.users[slot]:
            del self.held[adapter]
