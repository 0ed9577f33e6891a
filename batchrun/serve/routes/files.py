"""/v1/files: upload, list, read, download, delete."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse

from batchrun.serve.errors import APIError, not_found, paged
from batchrun.serve.options import ServeOptions
from batchrun.serve.store import LimitError, StateStore, public

log = logging.getLogger(__name__)


def router(store: StateStore, options: ServeOptions) -> APIRouter:
    api = APIRouter()

    def file_record(file_id: str) -> dict[str, Any]:
        record = store.file(file_id)
        if record is None:
            raise not_found("File", file_id)
        return record

    @api.post("/v1/files")
    def upload(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict[str, Any]:
        if purpose != "batch":
            raise APIError(400, f"purpose: batchrun serve takes files for the Batch API only (purpose 'batch'), "
                                f"got {purpose!r}", param="purpose")
        try:
            record = store.save_upload(file.file, filename=file.filename or "upload.jsonl", purpose=purpose,
                                       max_bytes=options.max_file_bytes, max_lines=options.max_requests)
        except LimitError as e:
            raise APIError(400, str(e), param="file") from None
        log.info("file %s: %s, %d bytes", record["id"], record["filename"], record["bytes"])
        return public(record)

    @api.get("/v1/files")
    def list_files(after: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                   order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> dict[str, Any]:
        files = [public(r) for r in store.files() if purpose is None or r["purpose"] == purpose]
        if order == "desc":
            files.reverse()
        return paged(files, after, limit, "File")

    @api.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict[str, Any]:
        return public(file_record(file_id))

    @api.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        record = file_record(file_id)
        return FileResponse(store.file_path(file_id), media_type="application/jsonl", filename=record["filename"])

    @api.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        if not store.delete_file(file_id):
            raise not_found("File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return api
