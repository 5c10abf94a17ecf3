"""The channel a tensor-parallel model's rank 0 drives its other ranks through: a fixed-length
op header, then the op's payload tensor, both broadcast from rank 0 over a gloo group (CPU
tensors, whatever the model's device). Workers replay the ops in the order rank 0 sent them, so
the ranks stay in lock-step by construction. A payload's shape follows from the op and its
header numbers alone: workers never see anything else of a request.

Also what every rank agrees on before the channel exists: the backend of the model's own
collectives and how long joining and loading may take."""

from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from node_agent.model.devices import is_cpu

HEADER_LEN = 5  # the op, then up to four numbers
RENDEZVOUS_TIMEOUT = timedelta(
    seconds=300
)  # joining and loading (workers import torch first: slow on a busy host)


def joined_key(rank: int) -> str:
    """The rendezvous store key a worker sets once it is up (rank 0 waits for every one)."""
    return f"cortex/joined/{rank}"


def backend(device: str) -> str:
    """The model's collectives: gloo between CPU ranks, NCCL between CUDA ranks."""
    return "gloo" if is_cpu(device) else "nccl"


class Op(IntEnum):
    FORWARD = 1  # rows start, batch, width, kv_len; payload int64 [3, batch, width]: ids, positions, write columns
    LOGITS = (
        2  # rows; payload [rows, hidden] in the model's dtype: hidden states to run the lm_head on
    )
    DECODE = 3  # batch, kv_len; payload int64 [2, batch]: tokens, positions
    MOVE_ROW = 4  # src, dst; no payload
    STOP = 5  # no payload: leave the loop, tear down
    TABLES = 6  # rows, max_blocks; payload int64 [rows, max_blocks]: rows 0..rows-1's block tables


def payload_shape(op: Op, numbers: list[int], hidden_size: int) -> tuple[int, ...] | None:
    if op == Op.FORWARD:
        return 3, numbers[1], numbers[2]
    if op == Op.LOGITS:
        return numbers[0], hidden_size
    if op == Op.DECODE:
        return 2, numbers[0]
    if op == Op.TABLES:
        return numbers[0], numbers[1]
    return None


class Channel:
    def __init__(self, group: dist.ProcessGroup, hidden_size: int, dtype: torch.dtype):
        self.group, self.hidden_size, self.dtype = group, hidden_size, dtype
        self._header = torch.zeros(HEADER_LEN, dtype=torch.long)

    def send(self, op: Op, *numbers: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast one op."""
        shape = payload_shape(op, list(numbers), self.hidden_size)
        if (payload is None) != (shape is None) or (
            payload is not None and tuple(payload.shape) != shape
        ):
            raise ValueError(
                f"{op.name} with {numbers} takes a payload of shape {shape}, not "
                f"{None if payload is None else tuple(payload.shape)}"
            )
        self._header.zero_()
        self._header[: len(numbers) + 1] = torch.tensor([op, *numbers])
        dist.broadcast(self._header, src=0, group=self.group)
        if payload is not None:
            dist.broadcast(payload.detach().to("cpu").contiguous(), src=0, group=self.group)

    def receive(self) -> tuple[Op, list[int], torch.Tensor | None]:
        """Another rank: wait for the next op and its payload."""
        dist.broadcast(self._header, src=0, group=self.group)
        op, numbers = Op(int(self._header[0])), self._header[1:].tolist()
        shape = payload_shape(op, numbers, self.hidden_size)
        if shape is None:
            return op, numbers, None
        payload = torch.empty(shape, dtype=self.dtype if op == Op.LOGITS else torch.long)
        dist.broadcast(payload, src=0, group=self.group)
        return op, numbers, payload
