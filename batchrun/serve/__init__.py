"""`batchrun serve`: OpenAI's Files and Batches API over the job pipeline, on one engine loaded for the
server's life (docs/serve.md). Only server.py, app.py, errors.py and routes/ import the ASGI stack (FastAPI,
uvicorn, python-multipart: the `batchrun[serve]` extra)."""
