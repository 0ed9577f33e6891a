"""What the `batchrun serve` tests share: a free port, request lines, polling a batch with the real SDK."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

TERMINAL = ("completed", "failed", "cancelled", "expired")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "any", "messages": [{"role": "user", "content": content}], **body}}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client, lines: list[Any], name: str = "input.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch")


def wait(client, batch_id: str, timeout: float = 60.0, until=lambda b: b.status in TERMINAL):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout} s"
        time.sleep(0.1)


def lines_of(client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def raw_request(method: str, url: str, *, key: str | None = None, body: bytes | None = None) -> tuple[int, Any]:
    """(status, parsed JSON answer) of one plain HTTP request, errors included."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def serving(settings, options, state_dir):
    """A `batchrun serve` in this process (uvicorn in a thread) until the block ends; yields its Server."""
    import uvicorn

    from batchrun.serve.server import build

    built = build(settings, options, str(state_dir))
    uv = uvicorn.Server(built.config())
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield built
    finally:
        uv.should_exit = True
        thread.join(30)
        built.store.close()


@contextlib.contextmanager
def serving_model(model_path, engine: list[str], state_dir, **options: Any):
    """`serving` a model with job-file engine settings (`engine.key=value`) and ServeOptions on a free port."""
    from batchrun.config import load_engine_settings
    from batchrun.serve.options import ServeOptions

    settings = load_engine_settings(str(model_path), None, engine)
    with serving(settings, ServeOptions(port=free_port(), **options), state_dir) as built:
        yield built


def sdk_client(server, key: str):
    """The `openai` SDK pointed at a server from `serving`."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.options.port}/v1", api_key=key, max_retries=0)


def reference_llm(model_path, engine: list[str]):
    """The same weights and engine settings as `serving_model`'s, through the Python API."""
    from batchrun import LLM
    from batchrun.config import load_engine_settings

    return LLM(str(model_path), **load_engine_settings(str(model_path), None, engine).engine_args().llm_kwargs())
