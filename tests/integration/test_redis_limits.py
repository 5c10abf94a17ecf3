"""Durable data is bounded, and Redis refusing writes is a clear 503: the files quota
(`files_max_total_bytes`), Redis out of memory and Redis as a read-only replica, against a real
gateway and redis-server."""

import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from shared.keys import Keys
from shared.processes import free_port, redis_answers, redis_server_argv
from tests.conftest import Service
from tests.stack import beat

pytestmark = pytest.mark.integration
KEYS = Keys()
QUOTA = 1000
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {"CORTEX_FILES_MAX_TOTAL_BYTES": str(QUOTA)}


def upload(base: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
        timeout=10,
    )


def test_files_share_one_quota(gateway_url, redis_url):
    client = redis.Redis.from_url(redis_url)
    first = upload(gateway_url, LINE * 7)
    assert first.status_code == 200 and int(client.get(KEYS.files_bytes())) == len(LINE) * 7

    refused = upload(gateway_url, LINE * 7)
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert (
        error["code"] == "files_quota_exceeded"
        and f"files_max_total_bytes={QUOTA}" in error["message"]
    )
    assert client.zcard(KEYS.files()) == 1

    assert httpx.delete(f"{gateway_url}/v1/files/{first.json()['id']}").status_code == 200
    assert int(client.get(KEYS.files_bytes())) == 0
    assert upload(gateway_url, LINE * 7).status_code == 200


def test_files_kept_before_the_count_existed_are_counted(gateway_url, redis_url):
    client = redis.Redis.from_url(redis_url)
    assert upload(gateway_url, LINE * 5).status_code == 200
    client.delete(KEYS.files_bytes())  # as a Redis written before the count existed

    assert upload(gateway_url, LINE * 5).status_code == 200
    assert int(client.get(KEYS.files_bytes())) == len(LINE) * 10
    assert upload(gateway_url, LINE * 5).json()["error"]["code"] == "files_quota_exceeded"


CHAT = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def full_redis(redis_url) -> Iterator[redis.Redis]:
    """The session's Redis past its maxmemory (noeviction) until the test ends: every write is refused,
    however its memory moves meanwhile (client buffers shrink, other clients come and go)."""
    client = redis.Redis.from_url(redis_url)
    beat(client)
    client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
    yield client
    client.config_set("maxmemory", 0)


def test_redis_out_of_memory_is_a_503_naming_it(gateway_url, full_redis):
    for answer in (
        upload(gateway_url, LINE * 3),
        httpx.post(f"{gateway_url}/v1/chat/completions", json=CHAT),
        httpx.post(f"{gateway_url}/v1/messages", json=CHAT),
    ):
        assert answer.status_code == 503, answer.text
        body = answer.json()
        message = body["error"]["message"]
        assert "Redis refuses writes: it is out of memory" in message and "LINE" not in message
        if "code" in body["error"]:
            assert body["error"]["code"] == "redis_out_of_memory"
        else:  # Anthropic's shape
            assert body["error"]["type"] == "overloaded_error"


def test_a_read_only_replica_is_a_503_naming_it(gateway_url, redis_url, tmp_path):
    port = free_port()
    primary = Service(
        "primary", redis_server_argv(port, workdir=tmp_path), tmp_path / "primary.log"
    )
    primary.wait_ready(lambda: redis_answers(f"redis://127.0.0.1:{port}/0"))
    replica = redis.Redis.from_url(redis_url)
    try:
        replica.replicaof("127.0.0.1", port)
        deadline = time.monotonic() + 10
        while (
            replica.info("replication")["master_link_status"] != "up"
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        answer = upload(gateway_url, LINE)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "redis_read_only"
        assert "read-only replica" in answer.json()["error"]["message"]
    finally:
        replica.replicaof("NO", "ONE")
        primary.stop()
