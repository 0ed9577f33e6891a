"""`batchrun serve` from start to stop: every check that needs no model as a JobError (exit 2), the engine
loaded once, then uvicorn until SIGINT / SIGTERM (the running batch commits, and resumes at the next start).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from batchrun.config import EngineSettings, JobError
from batchrun.engine_args import EngineArgsError, job_key
from batchrun.model.errors import ModelLoadError
from batchrun.pipeline.engine_api import engine_factory
from batchrun.plan import check_model
from batchrun.serve.options import ServeOptions
from batchrun.serve.store import StateStore, StoreError

log = logging.getLogger(__name__)


def require_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import python_multipart  # noqa: F401  (uploads)
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise JobError(f"batchrun serve needs FastAPI, uvicorn and python-multipart ({e.name} is missing): "
                       "pip install 'batchrun[serve]'") from None


def check_port(host: str, port: int) -> None:
    try:
        with socket.create_server((host, port), reuse_port=False) as s:
            s.close()
    except OSError as e:
        raise JobError(f"--port: cannot listen on {host}:{port} ({e.strerror or e})") from None


@dataclass
class Server:
    """A server's parts, built and checked; `run()` serves until stopped."""

    settings: EngineSettings
    options: ServeOptions
    store: StateStore
    engine: Any
    app: Any

    def config(self, **uvicorn_kwargs: Any) -> Any:
        import uvicorn

        return uvicorn.Config(self.app, host=self.options.host, port=self.options.port, log_config=None,
                              log_level="warning", timeout_graceful_shutdown=5, **uvicorn_kwargs)

    def run(self) -> int:
        """Serve until SIGINT (then 130) or SIGTERM (uvicorn raises it again once shut down: 143)."""
        import uvicorn

        model, host = self.settings.model["path"], self.options.host
        log.info("serving %s at http://%s:%d/v1 (state in %s)", model, host, self.options.port, self.store.root)
        if self.options.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s without --api-key: anyone who reaches the port can use the server", host)
        try:
            uvicorn.Server(self.config()).run()
        except KeyboardInterrupt:
            return 130
        finally:
            self.store.close()
        return 0


def build(settings: EngineSettings, options: ServeOptions, state_dir: str, *, check_listen: bool = True) -> Server:
    """Check everything, then load the engine. Raises JobError (exit 2) for what the user can fix."""
    require_packages()
    check_model(settings)
    store = StateStore(state_dir)
    try:
        store.open()
    except StoreError as e:
        raise JobError(str(e)) from None
    try:
        if check_listen:
            check_port(options.host, options.port)
        args = settings.engine_args()
        log.info("loading model %s", args.model)
        try:
            engine = engine_factory()(args.model, **args.llm_kwargs())
        except EngineArgsError as e:
            raise JobError(f"{job_key(e.field) or e.field}: {e.problem}") from None
        except ModelLoadError as e:
            raise JobError(f"model.path: {e}") from None
        from batchrun.serve.app import create_app
        from batchrun.serve.runner import BatchRunner

        runner = BatchRunner(store, settings, engine, options)
        app = create_app(store, runner, options, settings.model["path"])
    except BaseException:
        store.close()
        raise
    return Server(settings, options, store, engine, app)
