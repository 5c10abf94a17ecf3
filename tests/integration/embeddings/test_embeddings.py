"""`/v1/embeddings` end to end with the real OpenAI SDK (floats and its default base64) and
LangChain's `OpenAIEmbeddings`, against a stack serving tiny random embedding models: vectors equal
a reference computed here with transformers one input at a time."""

import json
import re
import time
import urllib.request

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests import tiny_poolers
from tests.stack import wait_for

pytestmark = pytest.mark.integration

TEXTS = [
    "The capital of France is Paris.",
    "Hello there!",
    "Write a poem about the sea and the sky",
    "1 2 3 4 5 6 7 8 9 10",
    "sea",
]


def vectors(response) -> np.ndarray:
    return np.array([item.embedding for item in sorted(response.data, key=lambda item: item.index)])


def tokens(folder, texts: list[str]) -> int:
    return sum(len(ids) for ids in AutoTokenizer.from_pretrained(folder)(texts)["input_ids"])


def test_openai_sdk_floats_and_its_default_base64(openai_client, pooler_dirs):
    expected = tiny_poolers.reference_vectors(pooler_dirs["embed"], TEXTS).numpy()
    floats = openai_client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(vectors(floats), expected, atol=1e-4)
    assert floats.model == "embed" and [item.index for item in floats.data] == list(
        range(len(TEXTS))
    )
    assert (
        floats.usage.prompt_tokens
        == floats.usage.total_tokens
        == tokens(pooler_dirs["embed"], TEXTS)
    )
    raw = openai_client.embeddings.with_raw_response.create(
        model="embedder", input=TEXTS[0]
    )  # base64 by default
    assert isinstance(json.loads(raw.text)["data"][0]["embedding"], str)
    np.testing.assert_allclose(vectors(raw.parse()), expected[:1], atol=1e-4)


def test_token_ids_are_embedded_as_the_models_own(openai_client, pooler_dirs):
    ids = AutoTokenizer.from_pretrained(pooler_dirs["embed"])(TEXTS[:2])["input_ids"]
    by_text = vectors(openai_client.embeddings.create(model="embed", input=TEXTS[:2]))
    np.testing.assert_allclose(
        vectors(openai_client.embeddings.create(model="embed", input=ids)), by_text, atol=1e-6
    )
    np.testing.assert_allclose(
        vectors(openai_client.embeddings.create(model="embed", input=ids[0])),
        by_text[:1],
        atol=1e-6,
    )
    with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary"):
        openai_client.embeddings.create(model="embed", input=[[100_000]])


def test_decoder_embedder_pools_its_last_token_and_truncates_dimensions(openai_client, pooler_dirs):
    full = tiny_poolers.reference_vectors(pooler_dirs["embed-last"], TEXTS, mode="last").numpy()
    np.testing.assert_allclose(
        vectors(openai_client.embeddings.create(model="embed-last", input=TEXTS)), full, atol=1e-4
    )
    cut = vectors(openai_client.embeddings.create(model="embed-last", input=TEXTS, dimensions=16))
    np.testing.assert_allclose(
        cut, full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True), atol=1e-4
    )
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.embeddings.create(model="embed", input="x", dimensions=16)
    assert (
        refused.value.body["param"] == "dimensions"
        and "not trained for truncated" in refused.value.message
    )


def test_wrong_kind_of_model_is_a_clear_400(openai_client):
    with pytest.raises(openai.BadRequestError) as chat_on_embedder:
        openai_client.chat.completions.create(
            model="embed", messages=[{"role": "user", "content": "hi"}]
        )
    assert chat_on_embedder.value.body == {
        "message": "embed is an embedding model: it serves /v1/embeddings, not chat, completions and messages",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_supported",
    }
    with pytest.raises(
        openai.BadRequestError,
        match="chat is a chat model: it serves chat, completions and messages, not /v1/embeddings",
    ):
        openai_client.embeddings.create(model="chat", input="hi")
    with pytest.raises(openai.BadRequestError, match="rerank is a rerank model"):
        openai_client.embeddings.create(model="rerank", input="hi")


def test_models_list_the_kind(openai_client):
    kinds = {model.id: model.kind for model in openai_client.models.list().data}
    assert kinds == {
        "embed": "embedding",
        "embedder": "embedding",
        "embed-last": "embedding",
        "embed-slow": "embedding",
        "rerank": "rerank",
        "chat": "generate",
    }


def _metric(url: str, name: str, model: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return sum(
        float(v)
        for v in re.findall(rf'^{re.escape(name)}\{{model="{model}"[^}}]*\}} (\S+)$', text, re.M)
    )


def test_256_inputs_take_a_few_forward_passes(openai_client, stack, pooler_dirs):
    inputs = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(256)]
    before = _metric(stack.gateway_url, "cortex:pooled_forwards_total", "embed")
    response = openai_client.embeddings.create(model="embed", input=inputs, encoding_format="float")
    passes = _metric(stack.gateway_url, "cortex:pooled_forwards_total", "embed") - before
    assert 1 <= passes <= 2, (
        passes
    )  # 256 inputs of 6-17 tokens under a budget of 8,192 tokens a pass
    np.testing.assert_allclose(
        vectors(response)[250:],
        tiny_poolers.reference_vectors(pooler_dirs["embed"], inputs[250:]).numpy(),
        atol=1e-4,
    )


def test_langchain_openai_embeddings(stack, pooler_dirs):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed"
    )
    url = f"{stack.gateway_url}/v1"
    expected = tiny_poolers.reference_vectors(pooler_dirs["embed"], TEXTS).numpy()
    texts = langchain_openai.OpenAIEmbeddings(
        model="embed", base_url=url, api_key="unused", check_embedding_ctx_length=False
    )
    np.testing.assert_allclose(texts.embed_documents(TEXTS), expected, atol=1e-4)
    np.testing.assert_allclose(texts.embed_query(TEXTS[0]), expected[0], atol=1e-4)
    # it tokenises with the model's own tokenizer and sends each text's chunks
    chunked = langchain_openai.OpenAIEmbeddings(
        model="embed",
        base_url=url,
        api_key="unused",
        tiktoken_enabled=False,
        tiktoken_model_name=str(pooler_dirs["embed"]),
    )
    np.testing.assert_allclose(chunked.embed_documents(TEXTS), expected, atol=1e-4)


def test_langchain_default_sends_tiktoken_ids(stack):
    """Its default tokenises with tiktoken's cl100k_base and sends the ids, which are not this
    model's: the 400 says to send text."""
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed"
    )
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed")
    try:
        tiktoken.get_encoding("cl100k_base")
    except Exception as exc:  # its encoding file comes from the internet on first use
        pytest.skip(
            f"tiktoken cannot load cl100k_base here (no network, nothing cached): {type(exc).__name__}"
        )
    default = langchain_openai.OpenAIEmbeddings(
        model="embed", base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0
    )
    with pytest.raises(openai.BadRequestError, match="should send text instead"):
        default.embed_documents(["The capital of France is Paris, a city of lights and museums."])


def test_batch_lines_of_embeddings(openai_client, pooler_dirs):
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "embed", "input": [text, TEXTS[0]], "encoding_format": "float"},
        }
        for i, text in enumerate(TEXTS)
    ]
    lines.append(
        {
            "custom_id": "wrong-kind",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "chat", "input": "hi"},
        }
    )
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = openai_client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = openai_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := openai_client.batches.retrieve(batch.id)).status not in {"completed", "failed"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (
        batch.status == "completed"
        and batch.request_counts.completed == 5
        and batch.request_counts.failed == 1
    )
    expected = tiny_poolers.reference_vectors(pooler_dirs["embed"], TEXTS).numpy()
    for line in map(
        json.loads, openai_client.files.content(batch.output_file_id).text.splitlines()
    ):
        i = int(line["custom_id"].removeprefix("e-"))
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "list"
        np.testing.assert_allclose(
            [item["embedding"] for item in body["data"]], expected[[i, 0]], atol=1e-4
        )
    (error,) = map(json.loads, openai_client.files.content(batch.error_file_id).text.splitlines())
    assert error["custom_id"] == "wrong-kind" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "model_not_supported"


def test_a_request_its_client_left_is_cancelled_on_the_node(openai_client, stack):
    """Its waiting inputs leave the device thread: the replica's slot is free again within a heartbeat
    or two, not after what is left of the 2,048 passes (~10 ms each on a quiet machine, one 122-token
    input a pass: 20 s or more) of the one left after 1.5 s; the model then answers the next request,
    and nothing is left in Redis (the fixture checks)."""
    leaving = openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=1.5
    )
    with pytest.raises(openai.APITimeoutError):
        leaving.embeddings.create(model="embed-slow", input=["the sea and the sky " * 24] * 2048)
    wait_for(
        lambda: stack.models_on("node-e")["embed-slow"]["slots_used"] == 0,
        8,
        "the left request's slot",
    )
    assert len(openai_client.embeddings.create(model="embed-slow", input=TEXTS).data) == len(TEXTS)


def test_the_ollama_client_embeds_as_the_openai_sdk_does(stack, pooler_dirs):
    """`/api/embed` (several inputs) and the older `/api/embeddings` (one prompt) through the real
    `ollama` client: the same vectors as the reference, the prompt's tokens counted."""
    import ollama

    client = ollama.Client(host=stack.gateway_url)
    expected = tiny_poolers.reference_vectors(pooler_dirs["embed"], TEXTS).numpy()
    answer = client.embed(model="embed", input=TEXTS)
    np.testing.assert_allclose(np.array(answer.embeddings), expected, atol=1e-4)
    assert (
        answer.prompt_eval_count == tokens(pooler_dirs["embed"], TEXTS) and answer.model == "embed"
    )
    old = client.embeddings(model="embedder:latest", prompt=TEXTS[0])
    np.testing.assert_allclose(np.array(old.embedding), expected[0], atol=1e-4)
    with pytest.raises(ollama.ResponseError) as wrong_kind:
        client.embed(model="chat", input="hi")
    assert wrong_kind.value.status_code == 400 and "chat is a chat model" in wrong_kind.value.error
