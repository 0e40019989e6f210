"""The OpenAI-compatible server, as vLLM's `vllm/entrypoints/openai/`: plumbing on top of chapter 10's
`AsyncLLM` (minivllm/engine/async_llm.py) and streaming (minivllm/entrypoints/openai_server.py).

    protocol.py    the request bodies (pydantic), the error body, SamplingParams from a request
    api_server.py  the FastAPI app (`build_app`): routes, API key, limits
    metrics.py     Prometheus metrics
    launcher.py    uvicorn: `run_server` (python -m minivllm serve) and `BackgroundServer`
"""
