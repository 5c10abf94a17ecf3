"""GET /v1/models and GET /health."""

from shared.catalog import DEFAULT_EMBEDDING_MODEL_ID
from shared.lifecycle import ModelState
from tests.unit.gateway.conftest import MODEL, beat

KERNELS = "int4: torch's int4 kernel below 4 rows, the node's tiles from 4 (AVX2 packing); decode step: compiled"


async def test_models_lists_the_catalogue_and_what_live_nodes_serve(client, redis):
    listed, embedder, alias, embedder_alias = (await client.get("/v1/models")).json()["data"]
    assert (listed["id"], listed["state"], listed["replicas"], listed["kind"]) == (
        MODEL,
        "not_loaded",
        [],
        "generate",
    )
    assert listed["max_model_len"] is None  # known once a replica has loaded it
    assert alias == listed | {
        "id": "default"
    }  # clients are told to ask for `default`: it is listed
    assert (embedder["id"], embedder["kind"]) == (
        DEFAULT_EMBEDDING_MODEL_ID,
        "embedding",
    )  # the built-in embedder
    assert embedder_alias == embedder | {"id": "default-embedding"}
    heartbeat = await beat(
        redis,
        "n1",
        {MODEL: ModelState.READY, "Poisoned-Model": ModelState.POISONED},
        max_model_len=8192,
        quant="int4",
        weight_mb=171,
        kernels=KERNELS,
    )
    await beat(redis, "n2", {"Loading-Model": ModelState.LOADING})
    await beat(redis, "n3", {"Dead-Model": ModelState.READY}, age_s=60)
    await beat(redis, "n4", {"Draining-Model": ModelState.READY}, state="draining")
    body = (await client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == [
        MODEL,
        DEFAULT_EMBEDDING_MODEL_ID,
        "Loading-Model",
        "default",
        "default-embedding",
    ]  # catalogue order first
    assert body["data"][0] == {
        "id": MODEL,
        "created": heartbeat.started_ms // 1000,
        "object": "model",
        "owned_by": "cortex",
        "state": "ready",
        "root": MODEL,
        "parent": None,
        "capabilities": [],
        "kind": "generate",
        "replicas": [
            {
                "node": "n1",
                "state": "ready",
                "slots_used": 0,
                "slots_total": 4,
                "download_fraction": None,
                "quant": "int4",
                "weight_mb": 171,
                "kernels": KERNELS,
            }
        ],
        "max_model_len": 8192,
    }  # the context the replica runs with, as vLLM shows it
    assert (
        body["data"][2]["state"] == "loading" and body["data"][2]["max_model_len"] is None
    )  # not loaded yet
    assert body["data"][3] == body["data"][0] | {"id": "default"}


async def test_retrieve_a_model_by_id_or_alias(client, redis):
    await beat(redis, "n1", {MODEL: ModelState.READY, "org/Live-Model": ModelState.READY})
    by_id = (await client.get(f"/v1/models/{MODEL}")).json()
    assert (by_id["id"], by_id["root"], by_id["state"]) == (MODEL, MODEL, "ready")
    assert (await client.get("/v1/models/default")).json() == by_id | {"id": "default"}
    assert (await client.get("/v1/models/org/Live-Model")).json()["root"] == "org/Live-Model"
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_health(client, fake_server):
    response = await client.get("/health")
    assert (response.status_code, response.json()["status"]) == (200, "ok")
    assert (
        "could not read INFO" in response.json()["redis"]["error"]
    )  # fakeredis has no INFO; real Redis: test_server
    fake_server.connected = False
    response = await client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"
    fake_server.connected = True
    assert (await client.get("/health")).status_code == 200


async def test_request_id_is_returned_and_generated(client):
    response = await client.get("/health", headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    generated = (await client.get("/health")).headers["x-request-id"]
    assert len(generated) == 32
    weird = (await client.get("/health", headers={"x-request-id": "a b\tc"})).headers[
        "x-request-id"
    ]
    assert weird != "a b\tc" and len(weird) == 32
