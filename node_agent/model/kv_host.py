"""The copies between the paged cache's device blocks and the tiers below it
(node_agent/engine/kv_tiers.py decides them, the runner makes them at the start of a step): the
host pool's slots (pinned memory on CUDA, so the copies run asynchronously on the device's stream,
in order with the forwards), and blocks as bytes for the disk tier.

A block's keys and values, over every attention layer, are one tensor [layers * 2, kv heads,
block_size * head dim] (keys then values, layer by layer): one contiguous run per block in the
host pool and in a disk file.
"""

import torch

from node_agent.model.kv_cache import PagedAttention, PagedCache


class BlockCopier:
    """`host_blocks` host slots for `cache`'s blocks (0: no host tier, bytes only)."""

    def __init__(self, cache: PagedCache, host_blocks: int):
        self.layers = [layer for layer in cache.layers if isinstance(layer, PagedAttention)]
        heads, _, dim = self.layers[0].keys.shape
        self.dtype, self.device = self.layers[0].keys.dtype, self.layers[0].keys.device
        self.shape = (2 * len(self.layers), heads, cache.block_size * dim)
        self.host_blocks = host_blocks
        self.host = torch.zeros(
            (host_blocks, *self.shape) if host_blocks else (0,),
            dtype=self.dtype,
            pin_memory=host_blocks > 0 and self.device.type == "cuda",
        )

    @property
    def block_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2] * self.dtype.itemsize

    @property
    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def _runs(self) -> list[torch.Tensor]:
        """Each layer's keys and values as [heads, blocks + 1, block_size * dim] views."""
        return [
            pool.view(self.shape[1], -1, self.shape[2])
            for layer in self.layers
            for pool in (layer.keys, layer.values)
        ]

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' contents, [n, *shape], on the device."""
        index = self._index(blocks)
        return torch.stack([run.index_select(1, index) for run in self._runs()]).permute(2, 0, 1, 3)

    def scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write `data` ([n, *shape], on the device) into the blocks."""
        index = self._index(blocks)
        for i, run in enumerate(self._runs()):
            run.index_copy_(1, index, data[:, i].transpose(0, 1))

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot): copy each block into its slot."""
        if not pairs:
            return
        data = self.gather([block for block, _ in pairs])
        if self.device.type == "cpu":
            self.host.index_copy_(0, torch.tensor([slot for _, slot in pairs]), data)
        else:
            for i, (_, slot) in enumerate(pairs):
                self.host[slot].copy_(data[i], non_blocking=True)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(host slot, device block): copy each slot back into its block."""
        if not pairs:
            return
        if self.device.type == "cpu":
            data = self.host.index_select(0, torch.tensor([slot for slot, _ in pairs]))
        else:
            data = torch.empty((len(pairs), *self.shape), dtype=self.dtype, device=self.device)
            for i, (slot, _) in enumerate(pairs):
                data[i].copy_(self.host[slot], non_blocking=True)
        self.scatter([block for _, block in pairs], data)

    def load(self, pairs: list[tuple[bytes, int]]) -> None:
        """(payload, device block): write each block's bytes (from the disk tier) into it."""
        if not pairs:
            return
        data = torch.stack(
            [torch.frombuffer(bytearray(p), dtype=self.dtype).view(self.shape) for p, _ in pairs]
        )
        self.scatter([block for _, block in pairs], data.to(self.device))

    def save(self, blocks: list[int]) -> list[bytes]:
        """The blocks' contents as bytes (for the disk tier)."""
        if not blocks:
            return []
        data = self.gather(blocks).cpu().contiguous()
        return [data[i].view(torch.uint8).numpy().tobytes() for i in range(len(blocks))]
