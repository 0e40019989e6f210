"""Command line:

    python -m minivllm generate "ROMEO:" --max-tokens 50
    python -m minivllm generate "ROMEO:" --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python -m minivllm serve [MODEL] [--port 8000] [--api-key KEY]    # an OpenAI-compatible server (chapter 10)
    python -m minivllm serve --data-parallel-size 2 --router prefix-aware   # replicas behind a router (chapter 12)
    python -m minivllm bench [--num-prompts 64 ...]
    python -m minivllm explain-cache A.txt B.txt [--block-size 16]   # what B would reuse from A's cache

`serve`, `generate` and `bench` take vLLM's engine arguments, with vLLM's names (see minivllm/engine/arg_utils.py):
--model, --dtype, --quantization, --seed, --max-model-len, --tensor-parallel-size, --block-size,
--kv-cache-memory-bytes, --[no-]enable-prefix-caching, --max-num-batched-tokens, --max-num-seqs,
--[no-]enable-chunked-prefill, --attention-backend, --speculative-config. Every value is checked before a model is loaded.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

from minivllm.engine.arg_utils import EngineArgs, bounded_int

# explain-cache reads two prompts: a chat or a text far longer than any context, not a stream (/dev/zero)
MAX_PROMPT_FILE_BYTES = 4 * 2**20
# what one idle replica process takes (817 MiB measured with the tiny model), rounded up
REPLICA_MEMORY_BYTES = 2**30


def generate(args) -> int:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, n=args.n, stop=args.stop or None)  # checked before the load
    llm = LLM(**EngineArgs.from_cli_args(args).llm_kwargs())
    for output in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        for completion in output.outputs:
            print(output.prompt + completion.text)
            print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def served_names(args) -> tuple[list[str], str]:
    """vLLM's naming: the served names are --served-model-name's (the first one in responses), else the model
    argument as given; the model cards' `root` is the model argument (the embedded model's folder without one)."""
    from minivllm.model.loader import DEFAULT_MODEL

    names = args.served_model_name or [args.model or "minivllm"]
    return names, args.model or str(DEFAULT_MODEL)


def serve(args) -> int:
    import logging

    from minivllm import LLM
    from minivllm.entrypoints.openai.launcher import run_server

    # as vLLM: --api-key, else $VLLM_API_KEY (and minivllm's own $MINIVLLM_API_KEY before it)
    api_key = args.api_key or os.environ.get("MINIVLLM_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    names, model_path = served_names(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # the 4xx lines
    if args.data_parallel_size > 1:  # chapter 12: replica processes behind a router
        from minivllm.entrypoints.openai.dp_server import run_dp_server

        llm_kwargs = EngineArgs.from_cli_args(args).llm_kwargs()
        try:
            run_dp_server(args.data_parallel_size, args.router, llm_kwargs, args.host, args.port, names, api_key,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details)
        except KeyboardInterrupt:
            pass
        return 0
    llm = LLM(**EngineArgs.from_cli_args(args).llm_kwargs())
    try:
        run_server(llm, args.host, args.port, names, api_key=api_key, model_path=model_path,
                   access_log=not args.disable_uvicorn_access_log,
                   enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    except KeyboardInterrupt:
        pass
    return 0


def read_prompt_file(path: str):
    """A prompt for explain-cache: a text file, or a .json chat (a non-empty list of {role, content} messages).
    Only a regular file of at most MAX_PROMPT_FILE_BYTES is read, and no more than that many bytes of it."""
    import json

    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a prompt is read from a file, not a device or a pipe)")
    if info.st_size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"{path}: {info.st_size:,} bytes; a prompt file holds at most {MAX_PROMPT_FILE_BYTES:,}")
    with open(path, "rb") as file:
        data = file.read(MAX_PROMPT_FILE_BYTES + 1)
    if len(data) > MAX_PROMPT_FILE_BYTES:  # it grew since the stat
        raise ValueError(f"{path}: more than {MAX_PROMPT_FILE_BYTES:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None
    if not path.endswith(".json"):
        if not text.strip():
            raise ValueError(f"{path}: empty prompt")
        return text
    try:
        chat = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(chat, list) or not chat:
        raise ValueError(f"{path}: a chat is a non-empty list of {{role, content}} messages")
    for i, message in enumerate(chat):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{path}: message {i}: expected {{\"role\": str, \"content\": str}}")
    return chat


def explain_cache(args) -> int:
    from minivllm.model.loader import load_model
    from minivllm.tools.cache_autopsy import explain_cache as autopsy, format_autopsy

    prompt_a, prompt_b = read_prompt_file(args.a), read_prompt_file(args.b)  # before the model loads
    _, tokenizer = load_model(args.model)
    result = autopsy(tokenizer, prompt_a, prompt_b, args.block_size, args.salt_a, args.salt_b)
    print(format_autopsy(result, tokenizer))
    return 0


def replica_capacity() -> int:
    """Replica processes this machine can hold: one per CPU core, and REPLICA_MEMORY_BYTES of memory each."""
    import psutil

    return max(1, min(os.cpu_count() or 1, psutil.virtual_memory().available // REPLICA_MEMORY_BYTES))


def check_serve_args(args, parser) -> None:
    capacity = replica_capacity()
    if args.data_parallel_size > capacity:
        parser.error(f"argument --data-parallel-size: {args.data_parallel_size}: this machine holds at most "
                     f"{capacity} replicas ({os.cpu_count()} CPU cores, about 1 GiB of free memory per replica)")
    ranks = args.data_parallel_size * args.tensor_parallel_size
    if args.data_parallel_size > 1 and ranks > (os.cpu_count() or 1):
        parser.error(f"argument --tensor-parallel-size: {args.data_parallel_size} replicas x "
                     f"{args.tensor_parallel_size} ranks = {ranks} processes, more than the {os.cpu_count()} cores")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from minivllm.tools.bench import main as bench_main

        return bench_main(["engine", *argv[1:]])
    if argv and argv[0] == "grade":
        from minivllm.tools.grade import main as grade_main

        return grade_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m minivllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=[])
    EngineArgs.add_cli_args(gen)
    server = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions")
    server.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as vLLM's `vllm serve MODEL` (the same as --model, which it overrides)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="0: any free port (printed)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the names clients pass as `model` (the first in responses and metrics; default: the "
                             "model argument, or 'minivllm' for the embedded model)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every path but /health and /ping, /metrics "
                             "included (default: $MINIVLLM_API_KEY, else $VLLM_API_KEY, else none)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per request on stdout")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",  # vLLM's, off by default as there
                        help="report usage.prompt_tokens_details.cached_tokens (off: a client could learn from it "
                             "whether another client's prompt is cached)")
    server.add_argument("--data-parallel-size", "-dp", type=bounded_int(1), default=1,
                        help="engine replicas, each in its own process, behind one endpoint (chapter 12)")
    server.add_argument("--router", choices=["round-robin", "least-loaded", "prefix-aware"], default="prefix-aware",
                        help="how the front end picks a replica when --data-parallel-size > 1 (default: prefix-aware)")
    EngineArgs.add_cli_args(server)
    sub.add_parser("bench", help="throughput, TTFT and TPOT of the engine (see python -m minivllm bench --help)")
    sub.add_parser("grade", help="grade a class's notebooks: each runs contained (time, CPU, memory), each answer is "
                                 "re-checked in a fresh process; still use a container (python -m minivllm grade --help)")
    explain = sub.add_parser("explain-cache", help="which blocks of prompt B would be served from A's prefix cache")
    explain.add_argument("a", help="a text file, or a .json chat (a list of {role, content} messages)")
    explain.add_argument("b")
    explain.add_argument("--block-size", type=bounded_int(1, 1024), default=16)
    explain.add_argument("--salt-a", default=None)
    explain.add_argument("--salt-b", default=None)
    explain.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:  # as vLLM: the positional model takes precedence
        args.model = args.model_tag
    if args.command == "serve" and args.served_model_name is not None and not all(args.served_model_name):
        server.error("argument --served-model-name: an empty name")
    if args.command == "serve" and args.api_key is not None and not args.api_key.strip():
        server.error("argument --api-key: an empty key would let every client in; leave --api-key out to serve "
                     "without one")
    command_parser = {"generate": gen, "serve": server, "explain-cache": explain}.get(args.command, parser)
    if args.command in ("generate", "serve"):
        EngineArgs.from_cli_args(args).check(command_parser)
    if args.command == "serve":
        check_serve_args(args, command_parser)
    try:
        commands = {"explain-cache": explain_cache, "serve": serve, "generate": generate}
        return commands[args.command](args)
    except (ValueError, OSError) as error:
        command_parser.error(str(error))

