"""One streamed request is one trace across the fleet: the gateway's request span holds admission,
placement, the queue wait and the node's job, whose tokenisation, prefill and decode spans hang under
it, the context carried in the job from one part to the other. The gateway (under uvicorn) and the node
agent run in this process, so the in-memory exporter sees both parts' spans; the job still crosses a
real Redis, and the node's times come back from its output process."""

import asyncio
import logging

import pytest
import uvicorn
from openai import AsyncOpenAI

from gateway.http.server import create_app
from node_agent.serving.agent import NodeAgent
from shared.lifecycle import ModelState
from shared.processes import free_port
from shared.settings import GatewaySettings, NodeSettings
from tests.conftest import eventually

MAX_TOKENS = 6


@pytest.fixture
async def fleet(redis_url, tiny_dirs, tmp_path):
    """A node agent serving `tiny` and a gateway on a free port, both in this event loop; yields the gateway's URL."""
    models = tmp_path / "models.toml"
    models.write_text(
        f'[[models]]\nid = "tiny"\nsource = "{tiny_dirs["llama"]}"\ndtype = "float32"\nslots = 2\n'
        "max_model_len = 256\n"
    )
    agent = NodeAgent(
        NodeSettings(
            redis_url=redis_url,
            models=["tiny"],
            node_name="n1",
            models_file=models,
            convert_cache=None,
        )
    )
    node = asyncio.create_task(agent.run())
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(GatewaySettings(redis_url=redis_url, models_file=models)),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    gateway = asyncio.create_task(server.serve())
    try:
        await eventually(
            lambda: (
                server.started
                and (m := agent.models.get("tiny")) is not None
                and m.state == ModelState.READY
            ),
            120,
            "the gateway started and tiny ready",
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(gateway, 30)
        agent.stop()
        await asyncio.wait_for(node, 60)


async def finished(spans, names: set[str]) -> dict:
    """The finished spans by name, once all of `names` are there (the node's come when its job ends)."""
    await eventually(
        lambda: names <= {span.name for span in spans.get_finished_spans()},
        30,
        f"the spans {names}",
    )
    got = spans.get_finished_spans()
    assert sorted(span.name for span in got) == sorted(names)  # each once, nothing else
    return {span.name: span for span in got}


async def test_a_streamed_request_is_one_trace_across_gateway_and_node(spans, fleet, caplog):
    caplog.set_level(logging.INFO, logger="node_agent")
    client = AsyncOpenAI(base_url=f"{fleet}/v1", api_key="unused")
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in raw.parse()]
    assert chunks[-1].choices[0].finish_reason == "length"
    await client.close()

    named = await finished(
        spans,
        {
            "POST /v1/chat/completions",
            "admission",
            "placement",
            "queue wait",
            "node job",
            "tokenize",
            "prefill",
            "decode",
        },
    )
    request, job = named["POST /v1/chat/completions"], named["node job"]
    trace_id = request.context.trace_id
    assert raw.headers["x-trace-id"] == f"{trace_id:032x}"
    assert {span.context.trace_id for span in named.values()} == {trace_id}  # one trace
    assert request.parent is None
    for name in (
        "admission",
        "placement",
        "queue wait",
        "node job",
    ):  # the node's job under the request's span
        assert named[name].parent.span_id == request.context.span_id, name
    for name in ("tokenize", "prefill", "decode"):
        assert named[name].parent.span_id == job.context.span_id, name
    gateway_side = {"POST /v1/chat/completions", "admission", "placement", "queue wait"}
    for name, span in named.items():
        assert span.instrumentation_scope.name == (
            "cortex.gateway" if name in gateway_side else "cortex.node"
        ), name
    assert job.attributes["cortex.node"] == "n1" and job.attributes["cortex.model"] == "tiny"
    assert job.attributes["cortex.job"] == request.attributes["cortex.job"]
    assert (
        request.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        and request.status.is_ok
        and job.status.is_ok
    )
    # the node's spans follow each other inside its job, which ends before the request's span
    tokenize, prefill, decode = named["tokenize"], named["prefill"], named["decode"]
    assert job.start_time <= tokenize.start_time < tokenize.end_time <= prefill.start_time
    assert (
        prefill.start_time < prefill.end_time == decode.start_time < decode.end_time == job.end_time
    )
    assert job.end_time <= request.end_time
    admitted = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("node_agent") and "admitted" in r.getMessage()
    ]
    assert admitted and admitted[0].endswith(
        f" trace={trace_id:032x}"
    )  # the node's log line names the trace
