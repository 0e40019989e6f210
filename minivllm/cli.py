"""Command line:

    python -m minivllm generate "ROMEO:" --max-tokens 50
    python -m minivllm generate "ROMEO:" --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python -m minivllm serve [--port 8000] [--api-key KEY]    # an OpenAI-compatible server (chapter 10)
    python -m minivllm serve --data-parallel-size 2 --router prefix-aware   # replicas behind a router (chapter 12)
    python -m minivllm bench [--num-prompts 64 ...]
    python -m minivllm explain-cache A.txt B.txt [--block-size 16]   # what B would reuse from A's cache
"""

from __future__ import annotations

import argparse
import sys


def generate(args) -> int:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, n=args.n, stop=args.stop or None)
    llm = LLM(args.model, speculative_config=args.speculative_config)
    for output in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        for completion in output.outputs:
            print(output.prompt + completion.text)
            print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def serve(args) -> int:
    import os

    from minivllm import LLM
    from minivllm.entrypoints.openai.launcher import run_server

    api_key = args.api_key or os.environ.get("MINIVLLM_API_KEY") or None
    if args.data_parallel_size > 1:  # chapter 12: replica processes behind a router
        from minivllm.entrypoints.openai.dp_server import run_dp_server

        llm_kwargs = {"model": args.model, "speculative_config": args.speculative_config}
        try:
            run_dp_server(args.data_parallel_size, args.router, llm_kwargs, args.host, args.port,
                          args.served_model_name, api_key)
        except KeyboardInterrupt:
            pass
        return 0
    llm = LLM(args.model, speculative_config=args.speculative_config)
    try:
        run_server(llm, args.host, args.port, args.served_model_name, api_key=api_key,
                   access_log=not args.disable_uvicorn_access_log)
    except KeyboardInterrupt:
        pass
    return 0


def explain_cache(args) -> int:
    import json
    from pathlib import Path

    from minivllm.model.loader import load_model
    from minivllm.tools.cache_autopsy import explain_cache as autopsy, format_autopsy

    _, tokenizer = load_model(args.model)

    def read(path):
        text = Path(path).read_text()
        if Path(path).suffix == ".json":  # a chat: [{"role": ..., "content": ...}, ...]
            return json.loads(text)
        return text

    result = autopsy(tokenizer, read(args.a), read(args.b), args.block_size, args.salt_a, args.salt_b)
    print(format_autopsy(result, tokenizer))
    return 0


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def data_parallel_size(text: str) -> int:
    from minivllm.entrypoints.openai.dp_server import MAX_REPLICAS

    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer from 1 to {MAX_REPLICAS}")
    return int(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from minivllm.tools.bench import main as bench_main

        return bench_main(["engine", *argv[1:]])
    parser = argparse.ArgumentParser(prog="python -m minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default=None, help="checkpoint folder or hub name (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--speculative-config", type=json_object, default=None,
                     help='speculative decoding (chapter 9), as JSON: {"method": "ngram" or "draft_model", '
                          '"num_speculative_tokens": k, ...}')
    server = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions")
    server.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    server.add_argument("--served-model-name", default="minivllm", help="the name clients pass as `model`")
    server.add_argument("--speculative-config", type=json_object, default=None)
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every path but /health, /metrics included "
                             "(default: $MINIVLLM_API_KEY, else none)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per request on stdout")
    server.add_argument("--data-parallel-size", type=data_parallel_size, default=1,
                        help="engine replicas, each in its own process, behind one endpoint (chapter 12)")
    server.add_argument("--router", choices=["round-robin", "least-loaded", "prefix-aware"], default="prefix-aware",
                        help="how the front end picks a replica when --data-parallel-size > 1 (default: prefix-aware)")
    sub.add_parser("bench", help="throughput, TTFT and TPOT of the engine (see python -m minivllm bench --help)")
    explain = sub.add_parser("explain-cache", help="which blocks of prompt B would be served from A's prefix cache")
    explain.add_argument("a", help="a text file, or a .json chat (a list of {role, content} messages)")
    explain.add_argument("b")
    explain.add_argument("--block-size", type=int, default=16)
    explain.add_argument("--salt-a", default=None)
    explain.add_argument("--salt-b", default=None)
    explain.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    try:
        commands = {"explain-cache": explain_cache, "serve": serve, "generate": generate}
        return commands[args.command](args)
    except (ValueError, OSError) as error:
        parser.error(str(error))

