"""`dsq serve`: an OpenAI-compatible HTTP server over the native engine, with continuous batching
over a paged KV cache (engine.py, paged.py) and the API on Starlette + uvicorn (api.py)."""
