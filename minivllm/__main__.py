"""Command line: `python -m minivllm generate "ROMEO:" --max-tokens 50`, `python -m minivllm bench`."""

from __future__ import annotations

import argparse
import sys


def generate(args) -> int:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, n=args.n, stop=args.stop or None)
    llm = LLM(args.model, enable_prefix_caching=False)
    for output in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        for completion in output.outputs:
            print(output.prompt + completion.text)
            print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from minivllm.bench import main as bench_main

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
    sub.add_parser("bench", help="throughput, TTFT and TPOT of the engine (see python -m minivllm bench --help)")
    args = parser.parse_args(argv)
    try:
        return generate(args)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    raise SystemExit(main())
