"""A fleet on this machine: node agents with small CPU memory budgets serving tiny random models."""

from collections.abc import Iterator

import pytest

from tests.stack import Stack, start_stack

ADMIN_KEY = "test-admin-key"


def catalogue(tiny_dir, **models: dict) -> str:
    """models.toml with one tiny model per keyword (id = keyword), each 100 MB unless said."""
    blocks = []
    for model_id, extra in models.items():
        fields = {
            "source": str(tiny_dir),
            "dtype": "float32",
            "slots": 4,
            "max_model_len": 256,
            "memory_mb": 100,
        } | extra
        body = "\n".join(f"{k} = {_toml(v)}" for k, v in fields.items())
        blocks.append(f'[[models]]\nid = "{model_id}"\n{body}\n')
    return "\n".join(blocks)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


@pytest.fixture
def fleet_stack(tmp_path, tiny_dirs, request) -> Iterator[Stack]:
    """A stack whose catalogue comes from the test's `models` marker (see `catalogue`)."""
    marker = request.node.get_closest_marker("models")
    toml = catalogue(tiny_dirs["llama"], **(marker.kwargs if marker else {"tiny-a": {}}))
    stack = start_stack(
        tmp_path,
        toml,
        CORTEX_ADMIN_KEY=ADMIN_KEY,
        CORTEX_JANITOR_INTERVAL_S="0.5",
        CORTEX_HEARTBEAT_S="0.5",
        CORTEX_HEARTBEAT_TTL_S="3",
        CORTEX_NODE_TTL_S="3",
    )
    try:
        yield stack
    finally:
        stack.stop()
