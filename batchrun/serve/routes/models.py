"""/v1/models: the one model served, its id the --model value."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from batchrun.serve import shapes
from batchrun.serve.errors import APIError


def router(model: str) -> APIRouter:
    api = APIRouter()
    created = shapes.now()

    def model_object() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "batchrun"}

    @api.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object()]}

    @api.get("/v1/models/{model_id:path}")
    def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model:
            raise APIError(404, f"The model '{model_id}' does not exist (this server runs '{model}')",
                           param="model", code="model_not_found")
        return model_object()

    return api
