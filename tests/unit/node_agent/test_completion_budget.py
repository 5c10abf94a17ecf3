"""How many tokens a job may generate."""

import pytest

from node_agent.serving.completion_budget import completion_budget
from shared.catalog import ModelProfile


def profile(**fields) -> ModelProfile:
    return ModelProfile(id="m", source="/x", **fields)


@pytest.mark.parametrize(
    "fields, asked, budget",
    [
        ({}, 32000, 100),  # clamp (the default): what fits
        ({}, 50, 50),
        ({}, None, 100),  # the default 1024, cut to the room
        ({"default_max_tokens": 10}, None, 10),
        ({"default_max_tokens": None}, None, None),  # up to the context
        ({"max_tokens_policy": "reject"}, 32000, 32000),  # left for check_fits to refuse
        ({"max_tokens_policy": "reject"}, None, 100),  # a default is always cut
    ],
)
def test_completion_budget(fields, asked, budget):
    assert completion_budget(profile(**fields), max_len=150, prompt_len=50, asked=asked) == budget
