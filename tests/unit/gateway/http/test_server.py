"""`python -m gateway` against a real redis-server: start-up, the catalogue, shutdown, and Redis
restarting under it. These start processes (about a second each) and use the shared fixtures."""

import json
import shutil
import sys
import threading

import httpx
import pytest
import redis

from shared.catalog import DEFAULT_EMBEDDING_MODEL_ID, DEFAULT_MODEL_ID
from shared.keys import Keys
from shared.processes import free_port, redis_answers
from tests.conftest import Service, _http_ok, wait_until
from tests.stack import beat

pytestmark = pytest.mark.integration
KEYS = Keys()
HELLO = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}


def test_gateway_process(gateway_url, redis_url, tmp_path):
    response = httpx.get(f"{gateway_url}/health", headers={"x-request-id": "r-1"})
    assert (response.status_code, response.json()["status"], response.headers["x-request-id"]) == (
        200,
        "ok",
        "r-1",
    )
    reading = response.json()["redis"]  # the test Redis keeps nothing on disk: /health says so
    assert (reading["persistence"], reading["eviction_policy"], reading["maxmemory_mb"]) == (
        "none",
        "noeviction",
        0,
    )
    assert (
        0 < reading["used_memory_mb"] < 100
        and "Redis keeps nothing on disk" in reading["warnings"][0]
    )
    catalog = redis.Redis.from_url(redis_url).hgetall(KEYS.catalog())
    assert json.loads(catalog[DEFAULT_MODEL_ID.encode()])["aliases"] == ["default"]
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=HELLO)
    assert (
        response.status_code == 503 and response.json()["error"]["code"] == "insufficient_capacity"
    )
    assert [
        (m["id"], m["state"]) for m in httpx.get(f"{gateway_url}/v1/models").json()["data"]
    ] == [
        (DEFAULT_MODEL_ID, "not_loaded"),
        (DEFAULT_EMBEDDING_MODEL_ID, "not_loaded"),
        ("default", "not_loaded"),
        ("default-embedding", "not_loaded"),
    ]
    log = (
        tmp_path / "gateway.log"
    ).read_text()  # a healthcheck polling /health fills no log; the rest is there
    assert '"GET /health HTTP/1.1" 200' not in log and '"GET /v1/models HTTP/1.1" 200' in log
    assert (
        "Redis keeps nothing on disk" in log
    )  # the one warning at start: the test Redis has no persistence


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_redis_that_restarts_empty_fails_queued_requests_cleanly_then_recovers(tmp_path):
    port, gateway_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis_args = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    server = Service("redis-server", redis_args, tmp_path / "redis.log")
    server.wait_ready(lambda: redis_answers(url))
    env = {
        "CORTEX_REDIS_URL": url,
        "CORTEX_PORT": str(gateway_port),
        "CORTEX_REQUEST_TIMEOUT_S": "4",
        "PATH": "/usr/bin:/bin",
    }
    gateway = Service(
        "gateway", [sys.executable, "-m", "gateway"], tmp_path / "gateway.log", env=env
    )
    base = f"http://127.0.0.1:{gateway_port}"
    try:
        gateway.wait_ready(lambda: _http_ok(f"{base}/health"))
        client = redis.Redis.from_url(url)
        beat(client)
        answers = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=10)
            )
        )
        thread.start()
        wait_until(
            lambda: client.xlen(KEYS.jobs(DEFAULT_MODEL_ID)) == 1, 5, "the job queued"
        )  # no node answers it
        server.stop()
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        thread.join(1)
        assert (
            answers == []
        )  # a queued job waits for Redis to come back (up to CORTEX_REDIS_OUTAGE_WAIT_S)

        server = Service(
            "redis-server", redis_args, tmp_path / "redis2.log"
        )  # it kept nothing: the job is gone
        server.wait_ready(lambda: redis_answers(url))
        thread.join(10)
        assert answers and answers[0].status_code == 503, gateway.log_tail()
        assert answers[0].json()["error"]["code"] == "broker_unavailable"
        assert "lost or read while Redis restarted" in answers[0].json()["error"]["message"]
        wait_until(
            lambda: client.exists(KEYS.catalog()),
            5,
            "the gateway reconnected and rewrote its catalogue",
        )
        assert _http_ok(f"{base}/health")
        beat(client)
        response = httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=10)
        assert response.status_code == 504  # enqueued again; no node, so it times out, no hang
        assert client.xinfo_stream(KEYS.jobs(DEFAULT_MODEL_ID))["entries-added"] == 1
        assert (
            client.xlen(KEYS.jobs(DEFAULT_MODEL_ID)) == 0
        )  # then withdrawn: no node will run it for nobody
        assert gateway.stop() in (0, -15)  # uvicorn re-raises SIGTERM once it has shut down
        assert "Application shutdown complete" in gateway.log_tail()
    finally:
        gateway.stop()
        server.stop()
