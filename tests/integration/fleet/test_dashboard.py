"""`/dashboard` in a real headless Chromium against a running stack with two nodes and traffic: the
page shows both nodes and the model, a queue while requests wait, and refreshes itself without a
reload; once a key exists its data needs the admin key."""

import re
import shutil
import subprocess
import threading

import httpx
import openai
import pytest

from tests.integration.fleet.conftest import ADMIN_KEY
from tests.integration.fleet.test_failures import join_all
from tests.stack import wait_for

BUSY = {"tiny-a": {"max_replicas": 2, "slots": 1}}


def browse(url: str, tmp_path, seconds: float = 8) -> str:
    """The page's DOM after `seconds` of its own scripts running (Chromium's virtual time)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip(
            "Chromium is not installed (Debian's `chromium` package; scripts/setup installs it)"
        )
    out = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path}",
            f"--virtual-time-budget={int(seconds * 1000)}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def cell(dom: str, table: str, row: str) -> list[str]:
    """The cells of the row of `table` whose first cell is `row`."""
    body = re.search(rf'<table id="{table}">.*?</table>', dom, re.S).group(0)
    for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S):
        cells = [
            re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        ]
        if cells and cells[0] == row:
            return cells
    raise AssertionError(f"no row {row!r} in #{table}")


@pytest.mark.models(**BUSY)
def test_the_dashboard_shows_the_fleet_and_its_queue_live(fleet_stack, tmp_path):
    fleet_stack.start_gateway()
    for node in ("n1", "n2"):
        fleet_stack.start_node(node, models=["tiny-a"])
    url = fleet_stack.gateway_url
    wait_for(
        lambda: all(
            fleet_stack.models_on(n).get("tiny-a", {}).get("state") == "ready" for n in ("n1", "n2")
        ),
        120,
        "tiny-a ready on both nodes",
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask(i: int) -> None:
        client.completions.create(
            model="tiny-a",
            prompt=f"secret-prompt-{i}",
            max_tokens=400,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    waiting = lambda: sum(
        httpx.get(f"{url}/dashboard/data").json()["fleet"]["queues"][0]["queued"].values()
    )
    wait_for(lambda: waiting() > 0, 30, "requests waiting")

    dom = browse(f"{url}/dashboard", tmp_path / "open")
    assert (
        int(re.search(r'data-refreshes="(\d+)"', dom).group(1)) >= 2
    )  # it polled and redrew, no reload
    assert cell(dom, "nodes", "n1")[1] == "active" and cell(dom, "nodes", "n2")[1] == "active"
    assert {cell(dom, "models", "tiny-a")[2]} == {"ready"}
    assert cell(dom, "models", "tiny-a")[3].startswith(
        "none, "
    )  # a float32 checkpoint: weights not quantized
    assert int(cell(dom, "queues", "tiny-a")[1]) > 0
    assert "secret-prompt" not in dom  # never a prompt
    join_all(threads, 180)

    key = httpx.post(
        f"{url}/admin/keys",
        json={"name": "someone"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()["secret"]
    assert httpx.get(f"{url}/dashboard/data").status_code == 401  # a key exists: auth is on
    assert (
        httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {key}"}).status_code
        == 401
    )
    assert (
        httpx.get(
            f"{url}/dashboard/data", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).status_code
        == 200
    )
    refused = browse(f"{url}/dashboard", tmp_path / "refused", seconds=3)
    assert "refused: a valid admin key is required" in refused and "n1" not in refused
    admitted = browse(f"{url}/dashboard#key={ADMIN_KEY}", tmp_path / "admin", seconds=3)
    assert cell(admitted, "nodes", "n2")[1] == "active" and ADMIN_KEY not in admitted
