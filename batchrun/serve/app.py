"""The HTTP side of `batchrun serve` (FastAPI): the routes (serve/routes/) and the errors and key
(serve/errors.py). Handlers are plain functions in FastAPI's thread pool; no request waits on the engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from batchrun.serve import errors
from batchrun.serve.options import ServeOptions
from batchrun.serve.routes import batches, files, models
from batchrun.serve.runner import BatchRunner
from batchrun.serve.store import StateStore


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
    errors.install(app, options.api_key)
    app.include_router(models.router(model))
    app.include_router(files.router(store, options))
    app.include_router(batches.router(store, runner, options, model))
    return app
