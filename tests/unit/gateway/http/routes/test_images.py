"""Images through both dialects' routes: carried to a vision model's node in the job, 400 in the
dialect's own shape for a text-only model or a broken image, and `vision` in /v1/models."""

import asyncio
import base64

import pytest

from shared.catalog import DEFAULT_MODEL_ID
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from tests.image_files import data_uri, image_bytes
from tests.unit.gateway.conftest import KEYS, ScriptedNode, beat

VISION = "tiny-vl"
PNG = image_bytes()
HEADERS = {"x-api-key": "anything", "anthropic-version": "2023-06-01"}


@pytest.fixture
def settings(tmp_path) -> GatewaySettings:
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nid = "{DEFAULT_MODEL_ID}"\nsource = "/nowhere"\naliases = ["default"]\n\n'
        f'[[models]]\nid = "{VISION}"\nsource = "/nowhere"\nvision = true\n'
    )
    return GatewaySettings(
        redis_url="redis://fake", request_timeout_s=5.0, models_file=tmp_path / "models.toml"
    )


@pytest.fixture
async def vision_node(app, redis):
    await beat(redis, models={DEFAULT_MODEL_ID: ModelState.READY, VISION: ModelState.READY})
    scripted = ScriptedNode(redis)
    tasks = [
        asyncio.create_task(scripted.run(KEYS.jobs(model))) for model in (VISION, DEFAULT_MODEL_ID)
    ]
    yield scripted
    for task in [*tasks, *scripted.tasks]:
        task.cancel()
    await asyncio.gather(*tasks, *scripted.tasks, return_exceptions=True)


def openai_body(model: str, url: str) -> dict:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


def anthropic_body(model: str, data: bytes) -> dict:
    return {
        "model": model,
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(data).decode(),
                        },
                    },
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }


async def test_an_image_reaches_the_vision_models_node_in_both_dialects(client, vision_node):
    response = await client.post("/v1/chat/completions", json=openai_body(VISION, data_uri(PNG)))
    assert response.status_code == 200, response.text
    response = await client.post("/v1/messages", json=anthropic_body(VISION, PNG), headers=HEADERS)
    assert response.status_code == 200, response.text
    openai_job, anthropic_job = (entry.request() for entry in vision_node.entries)
    assert openai_job.images == anthropic_job.images == [PNG]
    assert openai_job.messages[0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image"},
    ]
    assert anthropic_job.messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "What is this?"},
    ]


async def test_a_text_only_model_answers_400_in_each_dialect(client, vision_node):
    response = await client.post("/v1/chat/completions", json=openai_body("default", data_uri(PNG)))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "text-only" in error["message"]
    assert error["param"] == "messages[0].content[1]"
    response = await client.post(
        "/v1/messages", json=anthropic_body("default", PNG), headers=HEADERS
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "text-only" in body["error"]["message"]
    assert vision_node.entries == []  # nothing was enqueued


async def test_a_corrupt_image_is_a_400_before_anything_is_queued(client, vision_node, redis):
    response = await client.post(
        "/v1/chat/completions", json=openai_body(VISION, data_uri(PNG[:50]))
    )
    assert response.status_code == 400
    assert "messages[0].content[1]: not a readable image" in response.json()["error"]["message"]
    response = await client.post(
        "/v1/messages", json=anthropic_body(VISION, b"GIF89a broken"), headers=HEADERS
    )
    assert (
        response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    )
    assert vision_node.entries == [] and await redis.xlen(KEYS.jobs(VISION)) == 0


async def test_models_list_says_which_models_read_images(client):
    models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert models[VISION]["capabilities"] == ["vision"]
    assert (
        models[DEFAULT_MODEL_ID]["capabilities"] == [] and models["default"]["capabilities"] == []
    )


async def test_responses_input_images_travel_the_same_way(client, vision_node):
    body = {
        "model": VISION,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": data_uri(PNG)},
                ],
            }
        ],
    }
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    job = vision_node.entries[0].request()
    assert job.images == [PNG] and {"type": "image"} in job.messages[-1]["content"]
    body["input"][0]["content"][1] = {
        "type": "input_image",
        "file_id": "file-abc",
    }  # no URL: not supported
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400 and "data: URI" in response.json()["error"]["message"]
