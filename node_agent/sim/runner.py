"""The runner of a simulated engine: the real `Engine` (scheduler, KV block pool, prefix cache and
marks) plans each step as it would on a device; this runs the plan without a model. Every sampled
row's next token is the byte of a fixed text at its position, so sequences run to `max_tokens`
(the text holds no end-of-sequence token) and their output reads as text. The seam is the engine's
own: a `StepPlan` in, a `StepResult` out (node_agent/model/step.py)."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from node_agent.engine.engine import Engine
from node_agent.model.loader import LoadedModel
from node_agent.model.step import Sampled, StepPlan, StepResult
from node_agent.sim.config import SimConfig
from node_agent.sim.tokenizer import byte_tokenizer
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest

TEXT = " lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor."


@dataclass
class SimCache:
    """What the engine reads of a paged cache: its geometry (the blocks hold nothing)."""

    blocks: int
    block_size: int
    max_len: int
    has_linear_attention: bool = False


class SyntheticRunner:
    decoder = None  # no compiled step: the replica's memory is the catalogue's `memory_mb`
    tiers = None  # no KV tiers below the device: the simulated cache is the device's alone

    def __init__(self, profile: ModelProfile, config: SimConfig, vocab: int, text_ids: list[int]):
        self.vocab, self.text_ids = vocab, text_ids
        self.cache = SimCache(config.kv_blocks, profile.block_size, profile.max_model_len)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def memory_bytes(self) -> int:
        return 0

    def run(self, plan: StepPlan, bitmask=None) -> StepResult:
        ids = self.text_ids
        return StepResult(
            sampled=[[Sampled(ids[position % len(ids)])] for position in plan.sample_positions]
        )

    def add_images(self, job: str, prompt_ids: list[int], images: dict[str, np.ndarray]) -> None:
        raise InvalidRequest("a simulated model reads no images", param="messages")

    def forget(self, job: str) -> None:
        pass

    def close(self) -> None:
        pass


def sim_engine(profile: ModelProfile, config: SimConfig, node: str) -> Engine:
    """A replica's engine: the real one over the synthetic runner and the byte tokenizer."""
    tokenizer = byte_tokenizer()
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None), config=None)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        dtype=torch.float32,
        context_len=profile.max_model_len,
        weight_bytes=(profile.memory_mb or 0) << 20,
    )
    runner = SyntheticRunner(profile, config, len(tokenizer), tokenizer.encode(TEXT))
    return Engine(loaded, profile, node, runner=runner)
