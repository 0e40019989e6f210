"""The OpenAI-compatible server, as vLLM's `vllm/entrypoints/openai/`: plumbing on top of chapter 10's
`AsyncLLM` (minivllm/engine/async_llm.py) and streaming (minivllm/entrypoints/openai_server.py).

    protocol.py    the request bodies (pydantic), the error body, SamplingParams from a request
    guards.py      Limits, the outermost guard (header count, API key, OPTIONS), bounded body reading, hang-ups
    api_server.py  the FastAPI app (`build_app`): routes and handlers
    metrics.py     Prometheus metrics
    health.py      "can serve": why the engine cannot (`/health` 503), and the watchdog that stops a dead server
    launcher.py    uvicorn: `run_server` (python -m minivllm serve), `ThreadedUvicorn`, `BackgroundServer`

Data parallelism (chapter 12), one job per module:

    replica.py     one replica process: chapter 10's app with its KV events published (`/kv_events`, operator key)
    supervisor.py  the replica processes: start, announce, restart one that exits (bounded), stop
    front.py       the front end: route, proxy, follow KV events, probe liveness
    dp_server.py   the launchers: `DataParallelServer`, `run_dp_server`
"""
