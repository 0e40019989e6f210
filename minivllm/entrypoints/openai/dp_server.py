"""Data parallelism behind one OpenAI-compatible endpoint (chapter 12's plumbing, not taught):
`python -m minivllm serve --data-parallel-size N --router {round-robin,least-loaded,prefix-aware}`.

The launchers. The pieces, one job each:

    replica.py     one replica: chapter 10's server with its KV events published (`/kv_events`), in a process
    supervisor.py  the replica processes: started together, each announcing its URL, stopped together
    front.py       the front end: route, proxy, follow the replicas' KV events, probe their liveness

`DataParallelServer` runs the front end in a background thread of this process (for the notebook and the tests);
`run_dp_server` runs it in the foreground. Development mode (`dev_mode=True`, or MINIVLLM_SERVER_DEV_MODE=1, as
vLLM's VLLM_SERVER_DEV_MODE) adds `/reset_prefix_cache` to the front end and to every replica; without it no
key holder can flush every tenant's cache.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from minivllm.distributed.router import PrefixAware, Router, check_policy
from minivllm.entrypoints.openai.api_server import Limits
from minivllm.entrypoints.openai.front import RouterFront, build_router_app
from minivllm.entrypoints.openai.replica import dev_mode_from_environment
from minivllm.entrypoints.openai.supervisor import MAX_REPLICAS, Replicas, check_data_parallel_size

__all__ = ["MAX_REPLICAS", "DataParallelServer", "run_dp_server"]


def front_tokenizer(model):
    """The replicas' tokenizer, never their weights: from a checkpoint folder's tokenizer files, or from a GGUF
    file's metadata, as the engine's GGUF loader reads it (without the tensors). None where there is none."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from minivllm.model.loader import TOKENIZER_FILES, resolve_model_path

    if model is not None and str(model).endswith(".gguf"):  # the replicas' own tokenizer, its metadata checked first
        from minivllm.model.gguf_loader import gguf_tokenizer, read_gguf

        return gguf_tokenizer(read_gguf(Path(model)))
    folder = resolve_model_path(model)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder)


class DataParallelServer:
    """N replica processes and the front end (in a background thread of this process), for the notebook and
    the tests:

        with DataParallelServer(2, "prefix-aware", llm_kwargs={"num_kv_blocks": 256}) as server:
            ... talk to server.url ...

    `front_options` go to the front end (`RouterFront`: the liveness probe's interval, timeout and failures).
    A replica whose process exits is restarted, at most `max_restarts` times (supervisor.py). Usage carries
    `prompt_tokens_details` only with `enable_prompt_tokens_details` (vLLM's --enable-prompt-tokens-details).
    """

    def __init__(self, size: int, policy: str = "prefix-aware", llm_kwargs: dict | None = None, model=None,
                 model_name: str = "minivllm", api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 threads: int | None = None, dev_mode: bool | None = None, enable_prompt_tokens_details: bool = False,
                 max_restarts: int = 3, **front_options):
        check_policy(policy)
        check_data_parallel_size(size)
        llm_kwargs = dict(llm_kwargs or {}) | ({"model": model} if model is not None else {})
        self.host, self.port, self.policy = host, port, policy
        self.size, self.llm_kwargs, self.model_name, self.api_key = size, llm_kwargs, model_name, api_key
        self.threads, self.front_options = threads, front_options
        self.prompt_details, self.max_restarts = enable_prompt_tokens_details, max_restarts
        self.dev_mode = dev_mode_from_environment() if dev_mode is None else dev_mode
        self.replicas: Replicas | None = None
        self._uvicorn = None

    def start(self) -> "DataParallelServer":
        from minivllm.entrypoints.openai.launcher import ThreadedUvicorn

        tokenizer = front_tokenizer(self.llm_kwargs.get("model"))
        self.replicas = Replicas(self.size, self.llm_kwargs, self.model_name, self.api_key, self.threads,
                                 dev_mode=self.dev_mode, enable_prompt_tokens_details=self.prompt_details,
                                 max_restarts=self.max_restarts)
        try:
            limits = Limits()
            self.app = build_router_app(self.replicas.urls, self.policy, tokenizer, self.block_size, self.api_key,
                                        limits, self.dev_mode, operator_key=self.replicas.operator_key,
                                        **self.front_options)
            self.front: RouterFront = self.app.state.front
            self._uvicorn = ThreadedUvicorn(self.app, limits, self.host, self.port, name="minivllm-router")
            self.port = self._uvicorn.port
            self._uvicorn.start()
            deadline = time.monotonic() + 60
            while not all(self.front.router.alive) and time.monotonic() < deadline:
                time.sleep(0.01)  # every event stream open: the index starts from the truth
            self.replicas.supervise()
        except BaseException:
            self.replicas.stop()
            raise
        return self

    @property
    def block_size(self) -> int:
        return self.llm_kwargs.get("block_size", 16)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def use_policy(self, policy: str, load_bound: int | None = PrefixAware.load_bound,
                   timeout: float = 30) -> None:
        """Start over, idle, with another routing policy and every replica's prefix cache empty (between two
        measurements; development mode only): the replicas reset their caches, and once their AllBlocksCleared
        events have reached the index, a new Router takes over."""
        check_policy(policy)
        if not self.dev_mode:
            raise RuntimeError("use_policy resets the replicas' caches: start the server with dev_mode=True")
        front = self.front
        seen = list(front.clears)
        answer = httpx.post(self.url + "/reset_prefix_cache", timeout=timeout,
                            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        if answer.status_code != 200:
            raise RuntimeError(f"reset_prefix_cache: {answer.status_code} {answer.text}")
        deadline = time.monotonic() + timeout
        live = [r for r, alive in enumerate(front.router.alive) if alive]
        while any(front.clears[r] <= seen[r] for r in live) and time.monotonic() < deadline:
            time.sleep(0.005)
        front.set_router(Router(self.size, policy, self.block_size, load_bound=load_bound))

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.stop()
            self._uvicorn = None
        if self.replicas is not None:
            self.replicas.stop()

    def __enter__(self) -> "DataParallelServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_dp_server(size: int, policy: str, llm_kwargs: dict, host: str = "127.0.0.1", port: int = 8000,
                  model_name: str = "minivllm", api_key: str | None = None,
                  enable_prompt_tokens_details: bool = False) -> None:
    """`python -m minivllm serve --data-parallel-size N`: until interrupted."""
    import uvicorn

    from minivllm.entrypoints.openai.launcher import bind, uvicorn_config

    check_policy(policy)
    check_data_parallel_size(size)
    dev_mode = dev_mode_from_environment()
    tokenizer = front_tokenizer(llm_kwargs.get("model"))
    replicas = Replicas(size, llm_kwargs, model_name, api_key, dev_mode=dev_mode,
                        enable_prompt_tokens_details=enable_prompt_tokens_details)
    try:
        limits = Limits()
        app = build_router_app(replicas.urls, policy, tokenizer, llm_kwargs.get("block_size", 16), api_key, limits,
                               dev_mode, operator_key=replicas.operator_key)
        replicas.supervise()
        sock = bind(host, port)
        names = model_name if isinstance(model_name, str) else ", ".join(model_name)
        print(f"minivllm serving {names!r} on http://{host}:{sock.getsockname()[1]}/v1 with {size} replicas "
              f"({', '.join(replicas.urls)}), router {policy}", flush=True)
        server = uvicorn.Server(uvicorn_config(app, limits, log_level="info", access_log=True))
        try:
            asyncio.run(server.serve(sockets=[sock]))
        finally:
            sock.close()
    finally:
        replicas.stop()
