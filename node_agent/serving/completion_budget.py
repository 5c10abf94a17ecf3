"""How many tokens a job may generate, from what it asked, its model's profile and the room its
prompt leaves in the context."""

from shared.catalog import ModelProfile


def completion_budget(
    profile: ModelProfile, max_len: int, prompt_len: int, asked: int | None
) -> int | None:
    """`asked`, else the model's `default_max_tokens` (None: up to the context). Under the
    `clamp` policy, and always for the default, it is cut to the room the prompt leaves, so the
    job runs with what fits and ends with `length`; under `reject` an `asked` that does not fit
    stays, for `check_fits` to refuse."""
    wanted = asked or profile.default_max_tokens
    if wanted is None or (asked and profile.max_tokens_policy == "reject"):
        return wanted
    return max(1, min(wanted, max_len - prompt_len))
