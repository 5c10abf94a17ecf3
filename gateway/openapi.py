"""The OpenAPI document as the gateway really answers: request validation fails with 400 (not
FastAPI's 422), every error comes in its dialect's shape (`gateway/errors.py`), and the
generation, embedding and rerank routes declare the objects they return (or an SSE stream, when
asked to stream)."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.errors import ANTHROPIC_PATHS
from gateway.protocol import anthropic, embeddings, openai, rerank

SUCCESS: dict[str, type[BaseModel]] = {  # POST path → what a non-streamed answer is
    "/v1/chat/completions": openai.ChatCompletion,
    "/v1/completions": openai.Completion,
    "/v1/embeddings": embeddings.CreateEmbeddingResponse,
    "/v1/rerank": rerank.RerankResponse,
    "/rerank": rerank.RerankResponse,
    "/v1/score": rerank.ScoreResponse,
    "/v1/messages": anthropic.Message,
    "/v1/messages/count_tokens": anthropic.MessageTokensCount,
}
STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
             "required": ["data"]}


def _component(components: dict[str, Any], model: type[BaseModel], prefix: str) -> dict[str, str]:
    """`model`'s serialised schema among the components, its names prefixed by its dialect (both
    dialects have a `Usage` and an `ErrorResponse`)."""
    schema = model.model_json_schema(mode="serialization", ref_template=f"#/components/schemas/{prefix}{{model}}")
    for name, definition in schema.pop("$defs", {}).items():
        components[prefix + name] = definition
    components[prefix + model.__name__] = schema
    return {"$ref": f"#/components/schemas/{prefix}{model.__name__}"}


def document(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    errors = {"OpenAI.": _component(components, openai.ErrorResponse, "OpenAI."),
              "Anthropic.": _component(components, anthropic.ErrorResponse, "Anthropic.")}
    for path, operations in doc["paths"].items():
        prefix = "Anthropic." if path.startswith(ANTHROPIC_PATHS) else "OpenAI."
        error = {"description": "An error, in the dialect's shape", "content": {"application/json": {"schema": errors[prefix]}}}
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.update({"4XX": error, "5XX": error})
            if method == "post" and path in SUCCESS:
                content = {"application/json": {"schema": _component(components, SUCCESS[path], prefix)}}
                if path in STREAMED:
                    content["text/event-stream"] = {"schema": SSE_EVENT}
                responses["200"] = {"description": "The answer (server-sent events when streamed)", "content": content}
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    app.openapi_schema = doc
    return doc
