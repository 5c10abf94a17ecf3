"""One gateway and one node serving tiny random vision models, Qwen2.5-VL (`tiny-vl`) and Qwen3.5
with vision (`tiny-vl35`: linear-attention layers), and a tiny text-only Llama (`tiny-text`); images
are limited to 64 KiB so an oversized one is cheap to send."""

from collections.abc import Iterator

import pytest

from tests.integration.fleet.conftest import catalogue
from tests.stack import Stack, serving

VISION, VISION_35, TEXT = "tiny-vl", "tiny-vl35", "tiny-text"
IMAGE_MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def vision_stack(tmp_path_factory, tiny_dirs, tiny_vision_dirs) -> Iterator[Stack]:
    vision = {"vision": True, "prefill_chunk_tokens": 16}
    toml = "\n".join(
        [
            catalogue(tiny_vision_dirs["qwen2_5_vl"], **{VISION: vision}),
            catalogue(tiny_vision_dirs["qwen3_5"], **{VISION_35: vision}),
            catalogue(tiny_dirs["llama"], **{TEXT: {}}),
        ]
    )
    with serving(
        tmp_path_factory.mktemp("vision"),
        toml,
        "n1",
        [VISION, VISION_35, TEXT],
        CORTEX_IMAGE_MAX_BYTES=str(IMAGE_MAX_BYTES),
    ) as stack:
        yield stack


@pytest.fixture
def stack(vision_stack: Stack) -> Iterator[Stack]:
    """The stack, checked afterwards for pending entries and stray keys."""
    yield vision_stack
    vision_stack.assert_clean()
