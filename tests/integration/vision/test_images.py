"""Images through the real SDKs (the ollama client's `images` too) to a real node running a tiny
Qwen2.5-VL; text-only models, broken, oversized and http images answer 400 in each dialect, and no
image URL makes a connection."""

import base64
import socket
import threading
from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest

from tests.image_files import data_uri, image_bytes
from tests.integration.vision.conftest import IMAGE_MAX_BYTES, TEXT, VISION, VISION_35

pytestmark = pytest.mark.integration
GREEDY = {"temperature": 0, "max_tokens": 6}
ANTHROPIC_GREEDY = {
    "max_tokens": 6,
    "extra_body": {"temperature": 0},
}  # this SDK no longer takes temperature
PNG, JPEG = image_bytes("PNG", (100, 80)), image_bytes("JPEG", (64, 64), seed=3)


@pytest.fixture
def openai_client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def anthropic_client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0)


def openai_messages(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def anthropic_messages(source: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image", "source": source},
            ],
        }
    ]


def base64_source(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}


@pytest.mark.parametrize("model", [VISION, VISION_35])
def test_both_sdks_send_an_image_and_get_the_same_greedy_answer(
    openai_client, anthropic_client, model
):
    chat = openai_client.chat.completions.create(
        model=model, messages=openai_messages(data_uri(PNG)), **GREEDY
    )
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in openai_client.chat.completions.create(
            model=model, messages=openai_messages(data_uri(PNG)), stream=True, **GREEDY
        )
        if chunk.choices
    )
    message = anthropic_client.messages.create(
        model=model, messages=anthropic_messages(base64_source(PNG)), **ANTHROPIC_GREEDY
    )
    assert chat.choices[0].message.content == streamed == message.content[0].text != ""
    assert chat.usage.prompt_tokens == message.usage.input_tokens > 20  # the image's tokens count
    counted = anthropic_client.messages.count_tokens(
        model=model, messages=anthropic_messages(base64_source(PNG))
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_the_ollama_client_sends_images_as_the_openai_sdk_does(stack, openai_client):
    """Ollama's base64 `images` go before the message's text, as Ollama puts them: the same prompt as
    an image part then a text part, so the same greedy answer; a text-only model refuses them."""
    client = ollama.Client(host=stack.gateway_url)
    assert (
        "vision" in client.show(VISION).capabilities
        and "vision" not in client.show(TEXT).capabilities
    )
    ask = "What is in this picture?"
    options = {"temperature": 0, "num_predict": GREEDY["max_tokens"]}
    reply = client.chat(
        model=VISION, messages=[{"role": "user", "content": ask, "images": [PNG]}], options=options
    )
    image_first = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(PNG)}},
                {"type": "text", "text": ask},
            ],
        }
    ]
    chat = openai_client.chat.completions.create(model=VISION, messages=image_first, **GREEDY)
    assert reply.message.content == chat.choices[0].message.content != ""
    assert reply.prompt_eval_count == chat.usage.prompt_tokens > 20  # the image's tokens count
    assert (
        client.generate(model=VISION, prompt=ask, images=[PNG], options=options).response
        == reply.message.content
    )
    with pytest.raises(ollama.ResponseError) as text_only:
        client.chat(model=TEXT, messages=[{"role": "user", "content": ask, "images": [PNG]}])
    assert text_only.value.status_code == 400 and "text-only" in text_only.value.error


def test_a_different_image_gives_a_different_prompt(anthropic_client):
    png = anthropic_client.messages.create(
        model=VISION, messages=anthropic_messages(base64_source(PNG)), **ANTHROPIC_GREEDY
    )
    jpeg = anthropic_client.messages.create(
        model=VISION,
        messages=anthropic_messages(base64_source(JPEG, "image/jpeg")),
        **ANTHROPIC_GREEDY,
    )
    assert (
        jpeg.usage.input_tokens != png.usage.input_tokens
    )  # another size: another number of image tokens


def test_models_advertise_vision(openai_client):
    models = {m.id: m for m in openai_client.models.list().data}
    assert models[VISION].capabilities == models[VISION_35].capabilities == ["vision"]
    assert models[TEXT].capabilities == []


def test_a_text_only_model_answers_400_in_both_dialects(openai_client, anthropic_client):
    with pytest.raises(openai.BadRequestError, match="text-only"):
        openai_client.chat.completions.create(
            model=TEXT, messages=openai_messages(data_uri(PNG)), **GREEDY
        )
    with pytest.raises(anthropic.BadRequestError, match="text-only") as caught:
        anthropic_client.messages.create(
            model=TEXT, messages=anthropic_messages(base64_source(PNG)), **ANTHROPIC_GREEDY
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "data, says",
    [
        (PNG[: len(PNG) // 2], "not a readable image"),
        (image_bytes("PNG", (400, 300)) + b"\0" * IMAGE_MAX_BYTES, "at most 65536"),
    ],
)
def test_corrupt_and_oversized_images_answer_400(openai_client, anthropic_client, data, says):
    with pytest.raises(openai.BadRequestError, match=says) as caught:
        openai_client.chat.completions.create(
            model=VISION, messages=openai_messages(data_uri(data)), **GREEDY
        )
    assert caught.value.param == "messages[0].content[1]"
    with pytest.raises(anthropic.BadRequestError, match=says):
        anthropic_client.messages.create(
            model=VISION, messages=anthropic_messages(base64_source(data)), **ANTHROPIC_GREEDY
        )


@pytest.fixture
def listener() -> Iterator[dict]:
    """A loopback TCP listener that counts the connections it is offered."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    seen = {"port": server.getsockname()[1], "connections": 0}
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            seen["connections"] += 1
            connection.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield seen
    stop.set()
    thread.join()
    server.close()


def test_http_images_are_refused_without_any_connection(openai_client, anthropic_client, listener):
    url = f"http://127.0.0.1:{listener['port']}/cat.png"
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        openai_client.chat.completions.create(model=VISION, messages=openai_messages(url), **GREEDY)
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
        anthropic_client.messages.create(
            model=VISION,
            messages=anthropic_messages({"type": "url", "url": url}),
            **ANTHROPIC_GREEDY,
        )
    with pytest.raises(openai.BadRequestError, match="text-only"):  # nor for a text-only model
        openai_client.chat.completions.create(model=TEXT, messages=openai_messages(url), **GREEDY)
    assert listener["connections"] == 0
