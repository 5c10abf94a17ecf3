"""The OpenAPI document as the gateway really answers: request validation fails with 400 (not
FastAPI's 422), every error comes in its dialect's shape (`gateway/http/errors.py`), and the
generation, embedding and rerank routes declare the objects they return (or a stream, when asked
to stream: SSE, and NDJSON lines for Ollama's)."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.dialects.protocol import anthropic, embeddings, ollama, openai, rerank
from gateway.http.errors import ANTHROPIC_PATHS, OLLAMA_PATHS
from gateway.jobs import ndjson, sse

SUCCESS: dict[str, type[BaseModel]] = {  # POST path → what a non-streamed answer is
    "/v1/chat/completions": openai.ChatCompletion,
    "/v1/completions": openai.Completion,
    "/v1/embeddings": embeddings.CreateEmbeddingResponse,
    "/v1/rerank": rerank.RerankResponse,
    "/rerank": rerank.RerankResponse,
    "/v1/score": rerank.ScoreResponse,
    "/v1/messages": anthropic.Message,
    "/v1/messages/count_tokens": anthropic.MessageTokensCount,
    "/api/chat": ollama.ChatResponse,
    "/api/generate": ollama.GenerateResponse,
    "/api/pull": ollama.ProgressResponse,
}
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
NDJSON_LINE = {"type": "string"}
STREAMED = {  # path → how its stream is framed
    "/v1/chat/completions": {sse.MEDIA_TYPE: {"schema": SSE_EVENT}},
    "/v1/completions": {sse.MEDIA_TYPE: {"schema": SSE_EVENT}},
    "/v1/messages": {sse.MEDIA_TYPE: {"schema": SSE_EVENT}},
    "/api/chat": {ndjson.MEDIA_TYPE: {"schema": NDJSON_LINE}},
    "/api/generate": {ndjson.MEDIA_TYPE: {"schema": NDJSON_LINE}},
    "/api/pull": {ndjson.MEDIA_TYPE: {"schema": NDJSON_LINE}},
}


def dialect(path: str) -> str:
    """The prefix of the dialect a path answers in (its error shape's and objects' names)."""
    return (
        "Anthropic."
        if path.startswith(ANTHROPIC_PATHS)
        else "Ollama."
        if path.startswith(OLLAMA_PATHS)
        else "OpenAI."
    )


def _component(components: dict[str, Any], model: type[BaseModel], prefix: str) -> dict[str, str]:
    """`model`'s serialised schema among the components, its names prefixed by its dialect (both
    dialects have a `Usage` and an `ErrorResponse`)."""
    schema = model.model_json_schema(
        mode="serialization", ref_template=f"#/components/schemas/{prefix}{{model}}"
    )
    for name, definition in schema.pop("$defs", {}).items():
        components[prefix + name] = definition
    components[prefix + model.__name__] = schema
    return {"$ref": f"#/components/schemas/{prefix}{model.__name__}"}


def document(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    errors = {
        "OpenAI.": _component(components, openai.ErrorResponse, "OpenAI."),
        "Anthropic.": _component(components, anthropic.ErrorResponse, "Anthropic."),
        "Ollama.": _component(components, ollama.ErrorResponse, "Ollama."),
    }
    for path, operations in doc["paths"].items():
        prefix = dialect(path)
        error = {
            "description": "An error, in the dialect's shape",
            "content": {"application/json": {"schema": errors[prefix]}},
        }
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.update({"4XX": error, "5XX": error})
            if method == "post" and path in SUCCESS:
                content = {
                    "application/json": {"schema": _component(components, SUCCESS[path], prefix)}
                }
                content |= STREAMED.get(path, {})
                responses["200"] = {
                    "description": "The answer (a stream when asked for one)",
                    "content": content,
                }
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = doc
    return doc
