"""`/v1/files`: upload (multipart, `purpose=batch`, JSONL), list, retrieve, content, delete; each
caller sees only its own files (the admin key sees all)."""

from typing import Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import JSONResponse, Response

from gateway.dialects.protocol.openai_batch import FileDeleted
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.stores.files import PURPOSES, check_batch_input
from shared.errors import InvalidRequest, PayloadTooLarge

router = APIRouter()

READ_CHUNK_BYTES = 1 << 20


async def _read_capped(upload: UploadFile, max_bytes: int) -> bytes:
    parts, size = [], 0
    while chunk := await upload.read(READ_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(
                f"the file is over the limit of {max_bytes} bytes (files_max_bytes)", param="file"
            )
        parts.append(chunk)
    return b"".join(parts)


@router.post("/v1/files")
async def upload_file(
    ctx: Ctx, caller: CallerDep, file: UploadFile = File(...), purpose: str = Form(...)
) -> JSONResponse:
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}", param="purpose"
        )
    limit = ctx.settings.files_max_bytes
    content = await _read_capped(file, limit)
    check_batch_input(content, max_bytes=limit, max_lines=ctx.settings.files_max_lines)
    meta = await ctx.files.create(
        content,
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        owner=caller.name,
        quota_bytes=ctx.settings.files_max_total_bytes,
    )
    return JSONResponse(meta.model_dump())


@router.get("/v1/files")
async def list_files(
    ctx: Ctx,
    caller: CallerDep,
    purpose: str | None = None,
    limit: int = Query(10_000, ge=1, le=10_000),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    files = await ctx.files.list(
        purpose=purpose, limit=limit, after=after, order=order, owner=caller.owner
    )
    return JSONResponse(files.model_dump())


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse((await ctx.files.get(file_id, caller.owner)).model_dump())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, ctx: Ctx, caller: CallerDep) -> Response:
    content = await ctx.files.content(file_id, caller.owner)
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    await ctx.files.delete(file_id, caller.owner)
    return JSONResponse(FileDeleted(id=file_id).model_dump())
