"""One gateway and one node serving a tiny random model, shared by a module's tests."""

from collections.abc import Iterator

import pytest

from tests.integration.fleet.conftest import catalogue
from tests.stack import Stack, serving

MODEL = "tiny-a"
MAX_REQUEST_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("isolation")
    toml = catalogue(tiny_dirs["llama"], **{MODEL: {"slots": 8}})
    with serving(
        root, toml, "n1", [MODEL], CORTEX_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES)
    ) as stack:
        yield stack
