"""The soak: a fleet as a user runs it (two gateway replicas, two nodes, a durable redis-server) under
sustained mixed traffic (streamed, non-streamed, cancelled and malformed requests) while each part
is hurt in turn: a node SIGKILLed, a node SIGTERMed (it drains), a node restarted under the same
name within a second, a node's output process killed, a gateway killed, Redis killed and restarted.

Every request ends, completed or with a clear error, before its deadline; every completed answer
is the uninterrupted one (greedy), so no text is doubled by a retry; outside the faults' windows
no request fails; afterwards no entry is pending, no job channel is subscribed, no key that should
expire lives for ever, and every slot is free. The faults run once in CI (~2 minutes); `pytest
--soak-s 240 …` repeats them for at least that long."""

import asyncio
import json
import multiprocessing
import statistics
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import count

import httpx
import psutil
import pytest

from gateway.dialects.protocol.bounds import POOLING_INPUTS_MAX
from shared.processes import redis_answers
from tests import tiny_poolers
from tests.conftest import Service, _http_ok, wait_until
from tests.integration.fleet.conftest import ADMIN_KEY, catalogue
from tests.stack import NODE_START_TIMEOUT_S, Stack, start_stack

pytestmark = pytest.mark.integration

MODEL = "tiny-soak"
EMBED = "embed-soak"  # the noisy tenant's embedding model
NODES = ("node-a", "node-b")
PROMPTS = ["Tell me a story.", "Name three colours.", "Count to five.", "Say something kind."]
MAX_TOKENS = 16
DEADLINE_S = 45.0  # no request may take longer (the gateways give up on a silent job after 20 s)
GRACE_S = 3.0  # a fault's window lasts this long after the part is back
CLIENTS = 4
MALFORMED = [
    (b"{not json", "application/json"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "application/json"),
    (
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}
        ).encode(),
        "application/json",
    ),
    (
        b'{"model": "tiny-soak", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "application/json",
    ),
]


@dataclass
class Outcome:
    kind: str  # stream | whole | cancel | malformed
    prompt: int
    started: float
    ended: float = 0.0
    status: int | None = None
    text: str = ""
    error: str = ""  # why it did not complete ("" when it did)

    @property
    def hung(self) -> bool:
        return self.ended - self.started > DEADLINE_S


@dataclass
class Window:
    fault: str
    start: float
    end: float = float("inf")

    def overlaps(self, outcome: Outcome) -> bool:
        return outcome.started <= self.end and outcome.ended >= self.start


def body(prompt: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def ask(url: str, kind: str, prompt: int) -> Outcome:
    outcome = Outcome(kind, prompt, time.monotonic())
    timeout = httpx.Timeout(DEADLINE_S + 5, connect=5)
    try:
        if kind == "malformed":
            raw, content_type = MALFORMED[prompt % len(MALFORMED)]
            response = httpx.post(
                f"{url}/v1/chat/completions",
                content=raw,
                timeout=timeout,
                headers={"content-type": content_type},
            )
            outcome.status = response.status_code
            refused = 400 <= response.status_code < 500 and clear_error(response.content)
            outcome.error = "" if refused else f"{response.status_code}: {response.text}"
        elif kind == "whole":
            response = httpx.post(
                f"{url}/v1/chat/completions", json=body(prompt, False), timeout=timeout
            )
            outcome.status = response.status_code
            if response.status_code == 200:
                outcome.text = response.json()["choices"][0]["message"]["content"]
            else:
                outcome.error = (
                    f"{response.status_code}: {clear_error(response.content) or response.text}"
                )
        else:
            read_stream(url, outcome, timeout)
    except httpx.TimeoutException as exc:
        outcome.error = f"hung: {type(exc).__name__}"
    except httpx.HTTPError as exc:  # the gateway it talked to died, or was not there
        outcome.error = f"connection: {type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return outcome


def clear_error(raw: bytes) -> str:
    """The message of an OpenAI-shaped error body ("" when the body is not one)."""
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""


def read_stream(url: str, outcome: Outcome, timeout: httpx.Timeout) -> None:
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body(outcome.prompt, True), timeout=timeout
    ) as got:
        outcome.status = got.status_code
        if got.status_code != 200:
            raw = got.read()
            outcome.error = f"{got.status_code}: {clear_error(raw) or raw!r}"
            return
        chunks, finished = 0, False
        for line in got.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                finished = finished or data == "[DONE]"
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                outcome.error = f"stream error: {chunk['error']['message']}"
                return
            for choice in chunk["choices"]:
                outcome.text += choice["delta"].get("content") or ""
                chunks += bool(choice["delta"].get("content"))
            if outcome.kind == "cancel" and chunks == 2:
                return  # the client leaves: the gateway cancels the job
        if not finished:
            outcome.error = "the stream ended without [DONE]"


def output_processes(node: psutil.Process) -> list[psutil.Process]:
    """The node's live output processes (one killed before may linger as a zombie a moment)."""
    found = []
    for child in node.children():
        try:
            if "node_agent.serving.output_process" in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


class Fleet:
    """The soak's stack and the faults it suffers."""

    def __init__(self, stack: Stack, redis_argv: list[str]):
        self.stack, self.redis_argv = stack, redis_argv
        self.nodes: dict[str, Service] = {}
        self.ports = [int(url.rsplit(":", 1)[1]) for url in stack.replicas]
        self.gateways = list(stack.services[1:3])

    def start_node(self, name: str) -> None:
        since_ms = int(time.time() * 1000)
        self.nodes[name] = self.stack.start_node(name, [MODEL])
        self.wait_ready(name, since_ms)

    def wait_ready(self, name: str, since_ms: int) -> None:
        """`name`'s heartbeat comes from a process started after `since_ms` and says its model is ready."""
        client = self.stack.client()

        def ready() -> bool:
            beat = client.hgetall(self.stack.keys.node(name))
            models = json.loads(beat.get(b"models", b"{}"))
            return (
                int(beat.get(b"started_ms", 0)) >= since_ms
                and models.get(MODEL, {}).get("state") == "ready"
            )

        wait_until(ready, NODE_START_TIMEOUT_S, f"node {name}", alive=self.nodes[name].alive)

    # ---- the faults: each returns once the part it hurt is back ----------------------------------
    def kill_node(self) -> None:
        self.nodes["node-b"].proc.kill()
        time.sleep(
            4.0
        )  # past the node TTL: the janitor settles its jobs (and puts non-streamed ones back)
        self.start_node("node-b")

    def terminate_node(self) -> None:
        node = self.nodes["node-a"]
        node.proc.terminate()  # SIGTERM: it stops reading and drains what it holds
        node.proc.wait(60)
        self.start_node("node-a")

    def restart_node_same_name(self) -> None:
        self.nodes["node-b"].proc.kill()
        self.start_node("node-b")  # at once: its predecessor's pending entries are its to settle

    def kill_output_process(self) -> None:
        node = psutil.Process(self.nodes["node-a"].proc.pid)
        [output] = output_processes(node)
        output.kill()
        client = self.stack.client()

        def reloaded() -> bool:  # a new output process, and the model ready again
            models = json.loads(client.hget(self.stack.keys.node("node-a"), "models") or b"{}")
            fresh = output_processes(node)
            return (
                fresh
                and fresh[0].pid != output.pid
                and models.get(MODEL, {}).get("state") == "ready"
            )

        wait_until(
            reloaded, NODE_START_TIMEOUT_S, "the model's reload", alive=self.nodes["node-a"].alive
        )

    def kill_gateway(self) -> None:
        self.gateways[0].proc.kill()
        time.sleep(1.0)
        self.stack.start_gateway(self.ports[0])
        self.gateways[0] = self.stack.services[-1]

    def kill_redis(self) -> None:
        self.stack.services[0].proc.kill()
        time.sleep(1.0)
        self.stack.services[0] = Service(
            "redis-server", self.redis_argv, self.stack.root / "redis-again.log"
        )
        self.stack.services[0].wait_ready(lambda: redis_answers(self.stack.redis_url))
        wait_until(
            lambda: all(_http_ok(f"{url}/health") for url in self.stack.replicas),
            30,
            "the gateways",
        )
        now_ms = int(time.time() * 1000)
        for name in NODES:  # beating again, their models ready
            wait_until(
                lambda: (
                    int(self.stack.client().hget(self.stack.keys.node(name), "heartbeat_ms") or 0)
                    > now_ms
                ),
                30,
                f"node {name}'s heartbeat",
            )

    FAULTS = (
        "kill_node",
        "terminate_node",
        "restart_node_same_name",
        "kill_output_process",
        "kill_gateway",
        "kill_redis",
    )


@pytest.fixture
def fleet(tmp_path, tiny_dirs) -> Fleet:
    embedder = tiny_poolers.build_embedder(tmp_path / "embedder")
    embedding = {"source": str(embedder), "kind": "embedding", "max_model_len": 128}
    stack = start_stack(
        tmp_path,
        catalogue(tiny_dirs["llama"], **{MODEL: {}, EMBED: embedding}),
        durable=True,
        CORTEX_ADMIN_KEY=ADMIN_KEY,
        CORTEX_JANITOR_INTERVAL_S="0.5",
        CORTEX_HEARTBEAT_S="0.5",
        CORTEX_HEARTBEAT_TTL_S="3",
        CORTEX_NODE_TTL_S="3",
        CORTEX_REQUEST_TIMEOUT_S="20",
    )
    try:
        stack.start_gateways(2)
        found = Fleet(stack, list(stack.services[0].proc.args))
        for name in NODES:
            found.start_node(name)
        yield found
    finally:
        stack.stop()


@pytest.mark.timeout(600)  # one pass took 242 s on a busy 2-core box (--soak-s adds its own)
def test_the_fleet_loses_nothing_while_each_part_is_killed_in_turn(fleet, request):
    stack = fleet.stack
    references = [ask(stack.replicas[0], "whole", prompt) for prompt in range(len(PROMPTS))]
    assert all(not r.error for r in references), [r.error for r in references]
    outcomes: list[Outcome] = []
    stop = threading.Event()
    numbers = count()

    def client(index: int) -> None:
        kinds = ["stream", "whole", "cancel", "whole", "stream", "malformed"]
        while not stop.is_set():
            n = next(numbers)
            outcomes.append(
                ask(stack.replicas[(n + index) % 2], kinds[n % len(kinds)], n % len(PROMPTS))
            )

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in clients:
        thread.start()
    windows: list[Window] = []
    soak_s = request.config.getoption("--soak-s")
    started = time.monotonic()
    while True:
        for fault in Fleet.FAULTS:
            time.sleep(3.0)  # steady traffic between faults
            window = Window(fault, time.monotonic())
            windows.append(window)
            getattr(fleet, fault)()
            window.end = time.monotonic() + GRACE_S
        if time.monotonic() - started >= soak_s:
            break
    time.sleep(GRACE_S + 3.0)
    stop.set()
    for thread in clients:
        thread.join(DEADLINE_S + 10)

    completed = [o for o in outcomes if not o.error]
    failed = [o for o in outcomes if o.error]
    assert len(outcomes) > 50 and len(completed) > len(outcomes) / 2, (
        len(outcomes),
        len(completed),
    )
    assert [o for o in outcomes if o.hung or o.error.startswith("hung")] == []
    for outcome in completed:  # the uninterrupted answer: nothing doubled, nothing lost
        if outcome.kind in ("stream", "whole"):
            assert outcome.text == references[outcome.prompt].text, (
                outcome,
                references[outcome.prompt].text,
            )
    outside = [o for o in failed if not any(w.overlaps(o) for w in windows)]
    assert outside == [], "\n".join(f"{o.kind} {o.error}" for o in outside)

    assert_nothing_leaks(stack)
    kinds = {
        kind: sum(o.kind == kind for o in completed)
        for kind in ("stream", "whole", "cancel", "malformed")
    }
    print(
        f"soak: {len(outcomes)} requests, {len(failed)} failed inside fault windows; completed {kinds}"
    )


def assert_nothing_leaks(stack: Stack) -> None:
    """No entry pending or queued (on a stream or in a waiting room), no stray key, no job channel
    subscribed, no key that should expire living for ever, every slot free."""
    client = stack.client()
    stack.assert_clean(timeout_s=30)
    wait_until(
        lambda: client.pubsub_channels(f"{stack.keys.prefix}events:*") == [],
        30,
        "job channels to close",
    )
    for pattern in ("eventlog:*", "metered:*", "detached:*", "session:*"):
        assert [
            k for k in client.scan_iter(f"{stack.keys.prefix}{pattern}") if client.ttl(k) == -1
        ] == [], pattern

    def slots_free() -> bool:
        return all(
            json.loads(client.hget(stack.keys.node(name), "models"))[MODEL]["slots_used"] == 0
            for name in NODES
        )

    wait_until(slots_free, 30, "every slot free")


# ---- a noisy tenant: one key's abuse must not hurt the others' streams ----------------------------

BYSTANDER_CLIENTS, BYSTANDER_STREAMS = 2, 8  # streams each bystander client runs one after another
FLOOD_IN_FLIGHT = 150  # the noisy key's requests kept queued or running at once during its flood


def make_key(stack: Stack, name: str, **limits: int) -> str:
    created = httpx.post(
        f"{stack.replicas[0]}/admin/keys",
        json={"name": name} | limits,
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert created.status_code == 200, created.text
    return created.json()["secret"]


def first_token_s(client: httpx.Client, url: str, secret: str, prompt: int) -> float:
    """A bystander's streamed chat: the seconds to its first token; it must run to [DONE]."""
    started, first = time.monotonic(), None
    with client.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body(prompt, True),
        headers={"authorization": f"Bearer {secret}"},
        timeout=httpx.Timeout(DEADLINE_S, connect=5),
    ) as got:
        assert got.status_code == 200, got.read()
        finished = False
        for line in got.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: "):
                continue
            if data == "[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.monotonic() - started
        assert finished and first is not None
    return first


def bystanders(stack: Stack, secret: str) -> list[float]:
    """Every bystander stream's time to its first token (each client on its own replica, keeping
    its connection as an SDK's client does: a new httpx client costs ~50 ms of this box's CPU, which
    is the client's, not the fleet's)."""
    found: list[float] = []

    def run(index: int) -> None:
        with httpx.Client() as client:
            for n in range(BYSTANDER_STREAMS):
                url = stack.replicas[index % 2]
                found.append(first_token_s(client, url, secret, n % len(PROMPTS)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(BYSTANDER_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S * BYSTANDER_STREAMS)
    assert len(found) == BYSTANDER_CLIENTS * BYSTANDER_STREAMS
    return found


@contextmanager
def noisy_client(send, *args) -> Iterator[list[int]]:
    """`send(stop, statuses, *args)` in a process of its own (a noisy tenant is another client, not
    threads sharing the measuring test's interpreter), until the block ends; yields the statuses it
    got so far, and fails the test with what `send` raised."""
    context = multiprocessing.get_context("spawn")
    stop, statuses, failure = context.Event(), context.Manager().list(), context.Queue()
    process = context.Process(target=_report, args=(send, stop, statuses, failure, *args))
    process.start()
    try:
        yield statuses
    finally:
        stop.set()
        process.join(300)
    assert process.exitcode == 0 and failure.empty(), failure.get(timeout=1)


def _report(send, stop, statuses, failure, *args) -> None:
    try:
        send(stop, statuses, *args)
    except BaseException:
        failure.put(traceback.format_exc())
        raise


def _flood(stop, statuses, urls: list[str], secret: str) -> None:
    """FLOOD_IN_FLIGHT short chats kept queued or running (half on each replica), each answered or
    refused fast (503 with Retry-After)."""

    async def one(client: httpx.AsyncClient, n: int) -> None:
        while not stop.is_set():
            answer = await client.post(
                f"{urls[n % 2]}/v1/chat/completions",
                json=body(n % len(PROMPTS), False),
                headers={"authorization": f"Bearer {secret}"},
            )
            assert answer.status_code == 200 or (
                answer.status_code == 503 and "retry-after" in answer.headers
            ), answer.text
            statuses.append(answer.status_code)

    async def flood() -> None:
        limits = httpx.Limits(max_connections=FLOOD_IN_FLIGHT + 10)
        timeout = httpx.Timeout(300, connect=5)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await asyncio.gather(*(one(client, n) for n in range(FLOOD_IN_FLIGHT)))

    asyncio.run(flood())


@contextmanager
def flood_of_queued_requests(stack: Stack, secret: str) -> Iterator[None]:
    """The noisy key keeps FLOOD_IN_FLIGHT short chats queued or running until the block ends."""
    with noisy_client(_flood, stack.replicas, secret) as statuses:
        client = stack.client()
        rooms = f"{stack.keys.prefix}waiting:*"
        wait_until(lambda: len(list(client.scan_iter(rooms))) > 0, 60, "the flood to queue")
        yield
    assert list(statuses).count(200) > FLOOD_IN_FLIGHT, len(statuses)


EMBED_RPM = 30  # the noisy tenant's embedding key: its rate limit, which it keeps reaching
EMBED_TEXT = "a sentence of some length for the embedder to pool"


def _embeds(stop, statuses, urls: list[str], key: str) -> None:
    """`/api/embed` at the input cap, then one over it, again and again; a 429 is waited out as its
    Retry-After says (a client at its rate limit)."""
    with httpx.Client(timeout=httpx.Timeout(DEADLINE_S, connect=5)) as client:
        for n in count():
            if stop.is_set():
                return
            inputs = POOLING_INPUTS_MAX + (n % 2)
            answer = client.post(
                f"{urls[n % 2]}/api/embed",
                json={"model": EMBED, "input": [f"{EMBED_TEXT} {i}" for i in range(inputs)]},
                headers={"authorization": f"Bearer {key}"},
            )
            expected = {200, 429} if inputs == POOLING_INPUTS_MAX else {400, 429}
            assert answer.status_code in expected, (inputs, answer.status_code, answer.text)
            if answer.status_code == 200:
                assert len(answer.json()["embeddings"]) == inputs
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                stop.wait(float(answer.headers["retry-after"]))


@contextmanager
def oversized_embeds(stack: Stack, secret: str) -> Iterator[None]:
    """The noisy tenant's embedding key sends `/api/embed` at the input cap (each answer many times
    the largest event a node publishes, so it travels through the job's result hash) and over it,
    at its rate limit: each ends 200, 400 (over the cap) or 429 (the limit)."""
    key = make_key(stack, "noisy-embed", rpm=EMBED_RPM)
    with noisy_client(_embeds, stack.replicas, key) as statuses:
        wait_until(lambda: 200 in statuses, 120, "the first oversized embed")
        yield
    assert {200, 400} <= set(statuses), list(statuses)


BATCH_LINES, BATCH_BUDGET = 1000, 400  # the noisy batch's lines, its key's tokens per day


@contextmanager
def batch_over_its_budget(stack: Stack, secret: str) -> Iterator[None]:
    """The noisy tenant's batch key (a daily budget of a few lines' tokens) runs a 1,000-line
    batch: it pauses once the budget is spent (still in progress, no line refused for it), having
    spent at most two lines' tokens past it (gateway/batch/runner.py paces a budgeted key's lines)."""
    key = make_key(stack, "noisy-batch", max_tokens_per_day=BATCH_BUDGET)
    headers = {"authorization": f"Bearer {key}"}
    url = stack.replicas[0]
    stack.start_batch_worker(CORTEX_ARQ_POLL_DELAY_S="0.1")
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body(i % len(PROMPTS), False),
            }
        )
        + "\n"
        for i in range(BATCH_LINES)
    )
    uploaded = httpx.post(
        f"{url}/v1/files",
        files={"file": ("noise.jsonl", lines.encode())},
        data={"purpose": "batch"},
        headers=headers,
    )
    assert uploaded.status_code == 200, uploaded.text
    created = httpx.post(
        f"{url}/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=headers,
    )
    assert created.status_code == 200, created.text
    batch = created.json()["id"]

    def state() -> dict:
        return httpx.get(f"{url}/v1/batches/{batch}", headers=headers).json()

    def spent() -> int:
        return httpx.get(
            f"{url}/admin/keys/noisy-batch", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        ).json()["tokens_today"]

    wait_until(lambda: spent() >= BATCH_BUDGET, 120, "the batch to spend its budget")
    try:
        yield  # paused: the other noises and the bystanders run beside it
    finally:
        paused, spent_then = state(), spent()
        cancelled = httpx.post(f"{url}/v1/batches/{batch}/cancel", headers=headers)
        assert cancelled.status_code == 200, cancelled.text
        wait_until(lambda: state()["status"] == "cancelled", 60, "the batch to cancel")
    counts = paused["request_counts"]
    assert paused["status"] == "in_progress" and counts["failed"] == 0, paused
    per_line = spent_then / counts["completed"]
    assert spent_then <= BATCH_BUDGET + 2 * per_line, (spent_then, counts)


# How much the bystanders' TTFT p50 may grow under the noise (issue 49's target: 2x). On this 2-core box
# (two nodes of 4 slots, two gateways, Redis and every client on it) the flood alone made it 5.5x (37 ->
# 204 ms) before newcomers' slots; 4.4-6.3x while nodes missed their newcomers' announcements; 1.6-3.2x
# on a Xeon once every bystander job was taken as a newcomer within a few ms. Since a job not streamed
# gets its tokens joined (a flood request's Redis commands 150 -> 97, its gateway's share of the CPU
# down) and an embedding pass beside the chat model is bounded to 25 ms (it was 65 ms, a bystander's
# first token waiting behind it), seven runs on a 2-core EPYC measured 1.23-2.17x (median 1.66x): what
# is left is the flood keeping both cores busy, and the quiet baseline's spread (21-33 ms; it is
# measured on both sides of the noise). The bound fails the regressions seen (4.4x and more) and not
# this spread; the test runs alone (`alone`: after the parallel run), as a neighbour's CPU moves it.
TTFT_UNDER_NOISE = 3.0

NOISES = (  # each: a context manager a noisy tenant's abuse runs within
    batch_over_its_budget,  # first: it spends its budget before the flood, then stays paused
    flood_of_queued_requests,
    oversized_embeds,
)


@pytest.mark.alone
@pytest.mark.timeout(600)
def test_a_noisy_tenant_does_not_slow_the_bystanders_streams(fleet):
    stack = fleet.stack
    noisy, bystander = make_key(stack, "noisy"), make_key(stack, "bystander")
    before = bystanders(stack, bystander)
    with ExitStack() as noise:
        for make in NOISES:
            noise.enter_context(make(stack, noisy))
        loud = statistics.median(bystanders(stack, bystander))
    quiet = statistics.median(before + bystanders(stack, bystander))  # both sides of the noise
    print(
        f"noisy tenant: bystanders' TTFT p50 {quiet * 1000:.0f} ms quiet, {loud * 1000:.0f} ms under the noise"
    )
    assert loud <= TTFT_UNDER_NOISE * quiet, (quiet, loud)
    assert_nothing_leaks(stack)
