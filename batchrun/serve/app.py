"""The HTTP side of `batchrun serve` (FastAPI): OpenAI's Files and Batches routes and /v1/models, the API key,
and every failure as OpenAI's error body, `{"error": {message, type, param, code}}`, with its status.

The handlers are plain functions (FastAPI runs them in its thread pool): they read and write the state store
and wake the runner; no request waits on the engine.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from batchrun.serve import shapes
from batchrun.serve.finish import live_counts
from batchrun.serve.options import ServeOptions
from batchrun.serve.runner import BatchRunner, CancelError
from batchrun.serve.store import LimitError, StateStore, public

log = logging.getLogger(__name__)

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.body = status, shapes.error_body(message, type, param, code)


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param="id")


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def create_app(store: StateStore, runner: BatchRunner, options: ServeOptions, model: str) -> FastAPI:
    """The app; its lifespan starts and stops the runner's threads."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="batchrun serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = shapes.now()

    # ------------------------------------------------------------ the key and the errors

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if options.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {options.api_key}".encode()):
                message = ("You didn't provide an API key: pass it as 'Authorization: Bearer KEY'" if not given
                           else "Incorrect API key provided.")
                return JSONResponse(shapes.error_body(message, code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code in (404, 405):
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(e.detail)
        return JSONResponse(shapes.error_body(message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
        param = ".".join(where) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(shapes.error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error in %s %s", request.method, request.url.path)
        return JSONResponse(shapes.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                            status_code=500)

    # ------------------------------------------------------------ models

    def model_object() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "batchrun"}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model:
            raise APIError(404, f"The model '{model_id}' does not exist (this server runs '{model}')",
                           param="model", code="model_not_found")
        return model_object()

    # ------------------------------------------------------------ files

    def file_record(file_id: str) -> dict[str, Any]:
        record = store.file(file_id)
        if record is None:
            raise not_found("File", file_id)
        return record

    @app.post("/v1/files")
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

    @app.get("/v1/files")
    def list_files(after: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                   order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> dict[str, Any]:
        files = [public(r) for r in store.files() if purpose is None or r["purpose"] == purpose]
        if order == "desc":
            files.reverse()
        return paged(files, after, limit, "File")

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict[str, Any]:
        return public(file_record(file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        record = file_record(file_id)
        return FileResponse(store.file_path(file_id), media_type="application/jsonl", filename=record["filename"])

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        if not store.delete_file(file_id):
            raise not_found("File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------ batches

    def batch_view(record: dict[str, Any] | None, batch_id: str) -> dict[str, Any]:
        """The batch object; a running batch's counts and usage are those of its committed lines."""
        if record is None:
            raise not_found("Batch", batch_id)
        view = public(record)
        if record["status"] in ("in_progress", "cancelling", "finalizing"):
            view["request_counts"], view["usage"] = live_counts(store.job_dir(batch_id),
                                                                record["request_counts"]["total"])
        return view

    @app.post("/v1/batches")
    def create_batch(body: CreateBatch) -> dict[str, Any]:
        if body.endpoint not in shapes.ENDPOINTS:
            raise APIError(400, f"endpoint: batchrun serve runs {' and '.join(shapes.ENDPOINTS)} batches, "
                                f"got {body.endpoint!r}", param="endpoint")
        if body.completion_window != shapes.COMPLETION_WINDOW:
            raise APIError(400, f"completion_window: only '{shapes.COMPLETION_WINDOW}' is supported, got "
                                f"{body.completion_window!r}", param="completion_window")
        check_metadata(body.metadata)
        source = store.file(body.input_file_id)
        if source is None:
            raise APIError(404, f"No such File object: {body.input_file_id}", param="input_file_id")
        if source["purpose"] != "batch":
            raise APIError(400, f"input_file_id: {body.input_file_id} has purpose {source['purpose']!r}; a batch "
                                "reads a file uploaded with purpose 'batch'", param="input_file_id")
        if (source.get("_lines") or 0) > options.max_requests:
            raise APIError(400, f"input_file_id: the file has {source['_lines']:,} requests, more than the "
                                f"limit of {options.max_requests:,}", param="input_file_id")
        record = shapes.batch_object(shapes.new_batch_id(), input_file_id=body.input_file_id,
                                     endpoint=body.endpoint, metadata=body.metadata, model=model,
                                     created_at=shapes.now(), window_s=options.completion_window_s)
        record = store.create_batch(record)
        runner.notify()
        log.info("batch %s: created from %s (%s)", record["id"], body.input_file_id, body.endpoint)
        return public(record)

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
        records = store.batches()
        records.reverse()  # newest first
        return paged([batch_view(r, r["id"]) for r in records], after, limit, "Batch")

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        return batch_view(store.batch(batch_id), batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        if store.batch(batch_id) is None:
            raise not_found("Batch", batch_id)
        try:
            record = runner.cancel(batch_id)
        except CancelError as e:
            raise APIError(400, str(e), param="batch_id") from None
        return batch_view(record, batch_id)

    return app


def paged(items: list[dict[str, Any]], after: str | None, limit: int, kind: str) -> dict[str, Any]:
    try:
        return shapes.page(items, after, limit)
    except KeyError:
        raise APIError(400, f"after: no such {kind} object: {after}", param="after") from None


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise APIError(400, f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most "
                                f"{MAX_METADATA_VALUE}; {key[:70]!r} is over", param="metadata")
