"""The Batch API with the official openai SDK against a real stack (tiny model, real arq worker)."""

import json
import time

import pytest

from tests.integration.batch.conftest import MODEL, chat_line, jsonl

pytestmark = pytest.mark.integration

PROMPTS = [f"Tell me about item number {i}." for i in range(10)]


def wait_status(client, batch_id: str, statuses: set[str], timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout_s}s: {batch}")


def output_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_200_line_batch_with_a_bad_line(client, batch_stack):
    expected = {}
    for prompt in PROMPTS:  # what the interactive API answers, greedy
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
        )
        expected[prompt] = answer.choices[0].message.content
    lines = [chat_line(f"req-{i}", PROMPTS[i % 10]) for i in range(200)]
    lines[17] = (
        b'{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    )
    lines[42] = chat_line("bad-body", "x", max_tokens=-3)
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "acceptance"},
    )
    assert batch.status == "validating" and batch.metadata == {"run": "acceptance"}
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (
        done.request_counts.total == 200
        and done.request_counts.completed == 198
        and done.request_counts.failed == 2
    )
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = output_lines(client, done.output_file_id)
    assert len(out) == 198 and len({o["custom_id"] for o in out}) == 198
    for o in out:
        i = int(o["custom_id"].removeprefix("req-"))
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert (
            o["response"]["body"]["choices"][0]["message"]["content"] == expected[PROMPTS[i % 10]]
        ), o
    errors = output_lines(client, done.error_file_id)
    assert {e["custom_id"] for e in errors} == {None, "bad-body"}
    broken = next(e for e in errors if e["custom_id"] is None)
    assert broken["error"]["code"] == "invalid_json" and "line 18" in broken["error"]["message"]
    bad_body = next(e for e in errors if e["custom_id"] == "bad-body")
    assert (
        bad_body["error"]["code"] == "invalid_request"
        and "max_tokens" in bad_body["error"]["message"]
    )
    listed = client.batches.list(limit=1)
    assert listed.data[0].id == batch.id
    batch_stack.assert_clean()


def submit_batch(client, lines: list) -> str:
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def wait_completed_at_least(client, batch_id: str, n: int, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.request_counts.completed >= n:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id}: {batch.request_counts}")


def test_cancel_midway_keeps_partial_output(client, batch_stack):
    batch_id = submit_batch(
        client,
        [chat_line(f"c-{i}", PROMPTS[i % 10], max_tokens=48, ignore_eos=True) for i in range(200)],
    )
    wait_completed_at_least(client, batch_id, 10)
    cancelling = client.batches.cancel(batch_id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_status(client, batch_id, {"cancelled", "completed", "failed"})
    assert done.status == "cancelled" and done.cancelled_at
    out = output_lines(client, done.output_file_id)
    assert 10 <= len(out) < 200 and len(out) == done.request_counts.completed
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert len({o["custom_id"] for o in out}) == len(out)
    batch_stack.assert_clean()


def test_worker_killed_midway_resumes_without_redoing_lines(client, batch_stack):
    batch_id = submit_batch(
        client,
        [chat_line(f"k-{i}", PROMPTS[i % 10], max_tokens=32, ignore_eos=True) for i in range(200)],
    )
    wait_completed_at_least(client, batch_id, 40)
    batch_stack.worker.proc.kill()  # SIGKILL: no clean-up at all
    batch_stack.worker.proc.wait()
    redis = batch_stack.client()
    before = {
        json.loads(v)["custom_id"]: v.decode()
        for v in redis.hvals(batch_stack.keys.batch_lines(batch_id, "out"))
    }
    assert 40 <= len(before) < 200
    batch_stack.worker = batch_stack.start_batch_worker()
    done = wait_status(client, batch_id, {"completed", "failed", "cancelled"})
    assert done.status == "completed" and done.request_counts.completed == 200
    out = {o["custom_id"]: o for o in output_lines(client, done.output_file_id)}
    assert sorted(out) == sorted(f"k-{i}" for i in range(200))
    for custom_id, line in before.items():  # the same job's answer: not run again
        assert out[custom_id] == json.loads(line)
    batch_stack.assert_clean()


def test_upload_over_the_line_limit_is_413(client):
    import openai

    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"{}\n" * 50_001), purpose="batch")
    assert caught.value.status_code == 413 and "50000 lines" in caught.value.message


def test_batch_lines_with_a_forced_tool_call_and_a_json_schema(client, batch_stack):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    lines = [
        chat_line(
            "tool",
            "Weather in Paris?",
            max_tokens=64,
            tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        chat_line(
            "json",
            "A number, as JSON.",
            max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        ),
    ]
    done = wait_status(client, submit_batch(client, lines), {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 2, done
    out = {
        o["custom_id"]: o["response"]["body"]["choices"][0]
        for o in output_lines(client, done.output_file_id)
    }
    (call,) = out["tool"]["message"]["tool_calls"]
    assert (
        out["tool"]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    )
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    answer = json.loads(out["json"]["message"]["content"])
    assert set(answer) == {"n"} and 0 <= answer["n"] <= 99
    batch_stack.assert_clean()


def test_anthropic_message_batch_round_trip(batch_stack):
    import anthropic

    client = anthropic.Anthropic(base_url=batch_stack.gateway_url, api_key="unused", max_retries=0)
    weather = {
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    }
    requests = [
        {
            "custom_id": "hello",
            "params": {
                "model": MODEL,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Hello"}],
            },
        },
        {
            "custom_id": "tool",
            "params": {
                "model": MODEL,
                "max_tokens": 64,
                "tools": [weather],
                "tool_choice": {"type": "tool", "name": "get_weather"},
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
            },
        },
        {
            "custom_id": "bad",
            "params": {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]},
        },
    ]
    batch = client.messages.batches.create(requests=requests)
    assert batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 3
    deadline = time.monotonic() + 300
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (
        batch.request_counts.succeeded == 2 and batch.request_counts.errored == 1 and batch.ended_at
    )
    assert [b.id for b in client.messages.batches.list(limit=5).data][0] == batch.id
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["hello"].type == "succeeded" and results["hello"].message.usage.output_tokens > 0
    (use,) = results["tool"].message.content
    assert (
        use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    )
    assert results["tool"].message.stop_reason == "tool_use"
    assert (
        results["bad"].type == "errored"
        and results["bad"].error.error.type == "invalid_request_error"
    )
    assert "max_tokens" in results["bad"].error.error.message
    batch_stack.assert_clean()


def test_cancelled_message_batch_reports_canceled_requests(batch_stack):
    import anthropic

    client = anthropic.Anthropic(base_url=batch_stack.gateway_url, api_key="unused", max_retries=0)
    requests = [
        {
            "custom_id": f"r{i}",
            "params": {
                "model": MODEL,
                "max_tokens": 120,
                "messages": [{"role": "user", "content": PROMPTS[i % 10]}],
            },
        }
        for i in range(100)
    ]
    batch = client.messages.batches.create(requests=requests)
    cancelling = client.messages.batches.cancel(batch.id)
    assert cancelling.processing_status in ("canceling", "ended") and cancelling.cancel_initiated_at
    deadline = time.monotonic() + 300
    while (batch := client.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    counts = batch.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.errored + counts.canceled == 100
    results = list(client.messages.batches.results(batch.id))
    assert (
        len(results) == 100 and sum(r.result.type == "canceled" for r in results) == counts.canceled
    )
    batch_stack.assert_clean()
