"""Job events → API objects: one module per dialect, no I/O."""

from typing import Protocol

from gateway.dialects.protocol.openai import CompletionUsage, PromptTokensDetails
from shared.wire import Usage


class JobInfo(Protocol):
    """What a rendered response says about its job (`gateway.jobs.job.Job` has these)."""

    id: str  # the job id
    created: int  # unix seconds
    model: str  # the catalogue id
    prompt_tokens: int  # the prompt's length, once the job's first event arrived (0 before)
    prompt_text: str | None  # the prompt's text, when the node was asked to echo it


def completion_usage(usage: Usage) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


DEFAULT_FINISH_REASON = "stop"  # a choice the node ended without saying why
