"""No log line of any part names the Redis password."""

import os
import shutil
import sys

import httpx
import pytest
import redis

from shared.keys import Keys
from shared.processes import free_port, redis_answers
from tests.conftest import Service, _http_ok

pytestmark = pytest.mark.integration
PASSWORD = "s3cret-redis-password"


def test_no_part_logs_the_redis_password(tmp_path):
    port = free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    server = Service(
        "redis-server",
        [
            shutil.which("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            PASSWORD,
            "--dir",
            str(tmp_path),
        ],
        tmp_path / "redis.log",
    )
    services = [server]
    try:
        server.wait_ready(lambda: redis_answers(url))
        gateway_port = free_port()
        env = os.environ | {
            "CORTEX_REDIS_URL": url,
            "CORTEX_LOG_LEVEL": "DEBUG",
            "CORTEX_PORT": str(gateway_port),
            "CORTEX_MODELS": "[]",
            "CORTEX_NODE_NAME": "n1",
        }
        for name, module in (
            ("gateway", "gateway"),
            ("node", "node_agent"),
            ("batch worker", "gateway.batch"),
        ):
            services.append(
                Service(name, [sys.executable, "-m", module], tmp_path / f"{module}.log", env=env)
            )
        base = f"http://127.0.0.1:{gateway_port}"
        services[1].wait_ready(lambda: _http_ok(f"{base}/health"))
        services[2].wait_ready(lambda: redis.Redis.from_url(url).exists(Keys().node("n1")), 120)
        answer = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 404
    finally:
        for service in reversed(services):
            service.stop()
    logs = {
        path.name: path.read_text(errors="replace")
        for path in tmp_path.glob("*.log")
        if path.name != "redis.log"
    }
    assert set(logs) == {"gateway.log", "node_agent.log", "gateway.batch.log"} and all(
        logs.values()
    )
    assert [name for name, text in logs.items() if PASSWORD in text] == []
