"""`batchrun serve`: OpenAI's Files and Batches API over the job pipeline, on one engine loaded for the
server's life (docs/serve.md).

- `shapes.py`: the OpenAI objects (file, batch, list page, error) as the `openai` SDK parses them.
- `store.py`: the state folder: uploaded files, each batch's record and job folder; one server at a time.
- `checks.py`: a batch's input, line by line, before it runs (the per-line problems become error lines).
- `source.py`: the OpenAI batch reader with those problems put in place of the bad lines.
- `finish.py`: a finished job's output.jsonl into the batch's output and error files, counts and usage.
- `runner.py`: the threads that check batches and run them, one at a time, in order of creation.
- `options.py`: the server's own settings (port, key, commit interval, limits).
- `app.py`: the HTTP routes (FastAPI), the API key, OpenAI's error answers.
- `server.py`: what the CLI calls: load the engine, start the runner, serve with uvicorn.

FastAPI, uvicorn and python-multipart are the `batchrun[serve]` extra; only app.py and server.py import them.
"""
