"""The `jinfer` command line: serve, generate and convert.

    jinfer serve [--model M] [--port 8000] [--config configs/X.toml] ...   (see serve/main.py)

    jinfer generate [--model M] [--chat] --prompt TEXT [--prompt TEXT ...] [--max-tokens N] ...
    jinfer generate [--model M] --input prompts.jsonl --output results.jsonl [sampling flags]
    jinfer convert SRC DST        # any supported model -> jinfer orbax checkpoint directory

Errors from bad input are printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args) -> int:
    import jinfer
    from jinfer.batch import run_jsonl

    if bool(args.prompt) == bool(args.input):
        raise ValueError("give either --prompt (repeatable) or --input FILE.jsonl with --output FILE.jsonl")
    if args.input and not args.output:
        raise ValueError("--input needs --output")
    t0 = time.perf_counter()
    options = {"dtype": args.dtype, "max_seq_len": args.max_seq_len, "max_slots": args.max_slots}
    llm = jinfer.LLM(args.model, **{k: v for k, v in options.items() if v is not None})
    name = args.model or "the embedded SmolLM2-135M-Instruct"
    engine, cache_mib = llm.engine.config, llm.engine.cache_bytes / 2**20
    print(
        f"loaded {name} in {time.perf_counter() - t0:.1f} s; KV cache {cache_mib:.0f} MiB "
        f"({engine.max_slots} slots x {engine.max_seq_len} positions, {engine.dtype})",
        file=sys.stderr,
    )
    sampling = jinfer.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if args.input:
        written = run_jsonl(llm, args.input, args.output, sampling, args.context_policy)
        print(f"wrote {written} results to {args.output}", file=sys.stderr)
        return 0
    if args.chat:
        results = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompt], sampling, args.context_policy
        )
    else:
        results = llm.generate(args.prompt, sampling, args.context_policy)
    for prompt, completion in zip(args.prompt, results, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "token_ids": completion.token_ids,
                "metrics": completion.metrics,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(completion.text if args.chat else prompt + completion.text)
    return 0


def _convert(args) -> int:
    from jinfer.weights import load_model, save_checkpoint

    t0 = time.perf_counter()
    loaded = load_model(args.src)
    save_checkpoint(args.dst, loaded)
    print(
        f"wrote {args.dst} ({loaded.config.architecture}, {time.perf_counter() - t0:.1f} s)", file=sys.stderr
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline")
    gen.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or jinfer checkpoint (default: embedded SmolLM2)",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL: {id, prompt | messages, sampling?} per line")
    gen.add_argument("--output", help="JSONL results, appended as they finish; a rerun skips done ids")
    gen.add_argument("--context-policy", choices=["error", "truncate", "drop_oldest"], default=None)
    gen.add_argument("--max-slots", type=int, default=None)
    gen.add_argument(
        "--chat", action="store_true", help="treat each prompt as a user message and apply the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--max-seq-len", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON record per prompt")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible server (see `jinfer serve --help`)", add_help=False
    )
    serve.set_defaults(func=None)

    conv = sub.add_parser("convert", help="write a jinfer (orbax) checkpoint from any supported model")
    conv.add_argument("src", help="HF directory, .gguf file or jinfer checkpoint")
    conv.add_argument("dst", help="output directory")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server parses its own (many) options
        from serve.main import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        # CheckpointError, TokenizerError and UnsupportedModelError are ValueErrors.
        print(f"jinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
