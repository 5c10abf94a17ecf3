"""Runs an Engine to completion in-process and gathers what each job said."""

from collections import deque
from dataclasses import dataclass, field

import torch

from node_agent.engine.engine import Engine, check_fits
from node_agent.serving import prompts
from shared.wire import (
    DoneEvent,
    Event,
    GenerationRequest,
    SamplingParams,
    pack_event,
    unpack_event,
)

PROMPTS = [
    "Hello there",
    "What is the capital of France?",
    "Write a poem about the sea and the sky",
    "1 2 3 4 5 6 7 8 9 10",
    "Why?",
    "Tell me about transformers and attention in detail please",
]


def full_forward_greedy(lm, prompt_ids: list[int], n: int) -> list[int]:
    """The ground truth: `n` greedy tokens, each from a plain full forward over everything so far
    (no cache, no generation config)."""
    ids = torch.tensor([prompt_ids], device=lm.device)
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.cat([ids, lm.model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


@dataclass
class Result:
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(
        default_factory=dict
    )  # when the request asked for them
    done: object = None
    deltas: int = 0


def request(
    job: str, content: str = "Hello there", kind: str = "chat", **sampling
) -> GenerationRequest:
    body = (
        {"messages": [{"role": "user", "content": content}]}
        if kind == "chat"
        else {"prompt": content}
    )
    return GenerationRequest(
        job=job, model="m", kind=kind, sampling=SamplingParams(**sampling), **body
    )


def add(engine: Engine, req: GenerationRequest) -> None:
    ids = prompts.prompt_ids(engine.lm.tokenizer, engine.profile, req)
    check_fits(engine.max_len, len(ids), req.sampling.max_tokens)
    engine.add(req, ids, 0.0)


def run(
    engine: Engine, *requests: GenerationRequest, max_steps: int = 10_000, join_every: int = 0
) -> dict[str, Result]:
    """Run `requests` to completion: all at once, or with `join_every` = k the i-th joins the
    running batch at step i * k."""
    results = {r.job: Result() for r in requests}
    arriving = deque(requests)
    for step in range(max_steps):
        while arriving and step >= (len(requests) - len(arriving)) * join_every:
            add(engine, arriving.popleft())
        if not (engine.has_work or arriving):
            break
        for job, events in engine.step():
            collect(results[job], events)
    return results


def collect(result: Result, events: list[Event]) -> None:
    for event in events:
        assert (
            unpack_event(pack_event(event)) == event
        )  # as a gateway reads it: its fields' types hold too
        if isinstance(event, DoneEvent):
            result.done = event
            continue
        result.deltas += 1
        for choice in event.choices:
            result.text[choice.index] = result.text.get(choice.index, "") + choice.text
            result.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
            result.logprobs.setdefault(choice.index, []).extend(choice.logprobs or [])
            if choice.prompt_logprobs is not None:
                result.prompt_logprobs[choice.index] = choice.prompt_logprobs
            if choice.finish_reason:
                result.finish[choice.index] = choice.finish_reason
