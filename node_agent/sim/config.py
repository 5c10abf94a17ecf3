"""What a simulated node's hardware is: how long a step, a load and an unload take, how many KV
blocks each replica's cache holds and how much memory the node offers its models. One config for
every node of a `--simulate` process (node_agent/sim/fleet.py sets it from the command line)."""

from pydantic import BaseModel, Field


class SimConfig(BaseModel):
    step_ms: float = Field(20.0, ge=0)  # one engine step (a batch of up to `slots` sequences)
    kv_blocks: int = Field(
        2048, ge=1
    )  # blocks in each replica's KV cache (of the model's block_size)
    load_s: float = Field(0.5, ge=0)  # a replica's load, from `loading` to `ready`
    unload_s: float = Field(0.1, ge=0)  # freeing a replica's device memory
    memory_mb: int = Field(24_000, ge=1)  # what the node's device offers its models

    @property
    def step_s(self) -> float:
        return self.step_ms / 1000
