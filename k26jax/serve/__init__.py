"""`k26jax serve`: an OpenAI-compatible server with continuous batching on the engine's compiled step.

server.py (load, warm, run uvicorn, drain on SIGTERM) -> app.py (FastAPI routes, SSE, text and logprobs)
-> scheduler.py (the engine thread: slots, admission, insert / step, faults) -> k26jax.engine.Decoder.
protocol.py holds OpenAI's request checks and error format, text.py the UTF-8 / stop-string stream,
metrics.py the Prometheus metrics.
"""
