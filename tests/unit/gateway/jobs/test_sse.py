"""SSE framing."""

from gateway.dialects.protocol.openai import Model
from gateway.jobs import sse


def test_frames():
    assert sse.data({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"\\u00e9"}\n\n'.encode()
    assert sse.data(Model(id="m", created=1, root="m")) == (
        b'data: {"id":"m","created":1,"object":"model","owned_by":"cortex","state":"not_loaded","replicas":[],'
        b'"root":"m","capabilities":[],"kind":"generate","max_model_len":null}\n\n'
    )
    assert sse.DONE == b"data: [DONE]\n\n"
    assert sse.HEADERS == {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
