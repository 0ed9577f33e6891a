"""/v1/batches: create (the runner takes it from there), list, read, cancel."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from batchrun.io.sources import POOLING_URLS
from batchrun.serve import shapes
from batchrun.serve.errors import APIError, not_found, paged
from batchrun.serve.finish import live_counts
from batchrun.serve.options import ServeOptions
from batchrun.serve.runner import BatchRunner, CancelError
from batchrun.serve.store import StateStore, public

log = logging.getLogger(__name__)

# OpenAI's metadata limits: pairs, key length, value length
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def router(store: StateStore, runner: BatchRunner, options: ServeOptions, model: str) -> APIRouter:
    api = APIRouter()

    def batch_view(record: dict[str, Any] | None, batch_id: str) -> dict[str, Any]:
        """The batch object; a running batch's counts and usage are those of its committed lines."""
        if record is None:
            raise not_found("Batch", batch_id)
        view = public(record)
        if record["status"] in ("in_progress", "cancelling", "finalizing"):
            view["request_counts"], view["usage"] = live_counts(store.job_dir(batch_id),
                                                                record["request_counts"]["total"])
        return view

    @api.post("/v1/batches")
    def create_batch(body: CreateBatch) -> dict[str, Any]:
        if body.endpoint not in shapes.ENDPOINTS:
            raise APIError(400, f"endpoint: batchrun serve runs {', '.join(shapes.ENDPOINTS)} batches, "
                                f"got {body.endpoint!r}", param="endpoint")
        pooling = getattr(runner.engine, "pooling", None)
        if pooling is not None and not pooling.generates and body.endpoint not in POOLING_URLS:
            raise APIError(400, f"endpoint: the served model pools only (it runs {', '.join(pooling.tasks())}): "
                                f"{body.endpoint} needs a model that generates", param="endpoint")
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

    @api.get("/v1/batches")
    def list_batches(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
        records = store.batches()
        records.reverse()  # newest first
        return paged([batch_view(r, r["id"]) for r in records], after, limit, "Batch")

    @api.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        return batch_view(store.batch(batch_id), batch_id)

    @api.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        if store.batch(batch_id) is None:
            raise not_found("Batch", batch_id)
        try:
            record = runner.cancel(batch_id)
        except CancelError as e:
            raise APIError(400, str(e), param="batch_id") from None
        return batch_view(record, batch_id)

    return api


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise APIError(400, f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most "
                                f"{MAX_METADATA_VALUE}; {key[:70]!r} is over", param="metadata")
