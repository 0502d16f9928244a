"""The `jinfer` command line: serve, generate, convert and finetune.

    jinfer serve [--model M] [--port 8000] [--config FILE|PRESET] ...   (see `jinfer serve --help`)

    jinfer generate [--model M] [--chat] --prompt TEXT [--prompt TEXT ...] [sampling flags]
    jinfer generate [--model M] --input prompts.jsonl --output results.jsonl [sampling flags]
    jinfer convert SRC DST        # any supported model -> jinfer orbax checkpoint directory
    jinfer finetune [--model M] --data train.jsonl [--held-out eval.jsonl] --output DIR [flags]

Sampling and engine flags are generated from `SamplingParams` and `EngineConfig`; sampling knobs
left unset take the model's defaults, as they do on the server and in `jinfer.LLM`. Errors from
bad input are printed as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _generate(args) -> int:
    import jinfer
    from jinfer.batch import run_jsonl
    from jinfer.config import EngineConfig
    from jinfer.options import given

    if bool(args.prompt) == bool(args.input):
        raise ValueError("give either --prompt (repeatable) or --input FILE.jsonl with --output FILE.jsonl")
    if args.input and not args.output:
        raise ValueError("--input needs --output")
    t0 = time.perf_counter()
    llm = jinfer.LLM(args.model, **given(args, EngineConfig))
    layout, cache_mib = llm.engine.layout, llm.engine.cache_bytes / 2**20
    name = args.model or "the embedded SmolLM2-135M-Instruct"
    print(
        f"loaded {name} in {time.perf_counter() - t0:.1f} s; KV pool {cache_mib:.0f} MiB "
        f"({layout.kv_cache_tokens} positions, {layout.max_slots} slots, {layout.dtype}); "
        f"{layout.describe()}",
        file=sys.stderr,
    )
    sampling = jinfer.SamplingParams(**given(args, jinfer.SamplingParams))
    print(f"sampling: {llm.preparer.sampling(sampling)}", file=sys.stderr)
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
            continue
        print(completion.text if args.chat else prompt + completion.text)
        if completion.finish_reason == "length":
            limit = (
                f"max_tokens={sampling.max_tokens}"
                if sampling.max_tokens
                else "the end of the context window"
            )
            print(f"[stopped at {limit}; --max-tokens N allows more]", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from jinfer.formats.checkpoint import save_checkpoint
    from jinfer.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.src, quantization=args.quantization)
    save_checkpoint(args.dst, loaded)
    print(
        f"wrote {args.dst} ({loaded.config.architecture}, {time.perf_counter() - t0:.1f} s)", file=sys.stderr
    )
    return 0


def _finetune(args) -> int:
    from jinfer.finetune import TrainConfig, finetune
    from jinfer.lora import LoraConfig
    from jinfer.options import given

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO lines, a dozen per checkpoint
    adapter = given(args, LoraConfig)
    if args.targets:
        adapter["targets"] = tuple(t.strip() for t in args.targets.split(","))
    history = finetune(
        args.model,
        args.data,
        args.output,
        held_out_path=args.held_out,
        config=TrainConfig(**given(args, TrainConfig)),
        adapter=LoraConfig(**adapter),
        full=args.full,
        progress=True,
    )
    what = "the model" if args.full else "the adapter"
    print(f"wrote {what} to {args.output}; last: {history[-1] if history else 'no update'}", file=sys.stderr)
    return 0


def _finetune_parser(sub) -> None:
    from jinfer.finetune import TrainConfig
    from jinfer.lora import LoraConfig
    from jinfer.options import add_flags

    tune = sub.add_parser("finetune", help="train a LoRA adapter (or every weight) on a JSONL file")
    tune.add_argument("--model", default=None, help="what to train from (default: the embedded SmolLM2)")
    tune.add_argument("--data", required=True, help='JSONL: {"messages": [...]} or {"prompt", "completion"}')
    tune.add_argument("--held-out", default=None, help="JSONL of the same kind, for the held-out loss")
    tune.add_argument("--output", required=True, help="the result and the checkpoints (a rerun resumes)")
    tune.add_argument("--full", action="store_true", help="train every weight instead of an adapter")
    tune.add_argument("--targets", default=None, help="the adapter's projections, e.g. q,v (default: all)")
    add_flags(tune, TrainConfig, title="training")
    add_flags(tune, LoraConfig, title="adapter")
    tune.set_defaults(func=_finetune)


def build_parser() -> argparse.ArgumentParser:
    from jinfer.config import CONTEXT_POLICIES, QUANTIZATIONS, EngineConfig
    from jinfer.options import add_flags
    from jinfer.sampling import SamplingParams

    parser = argparse.ArgumentParser(prog="jinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline")
    gen.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or jinfer checkpoint (default: the embedded SmolLM2)",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL: {id, prompt | messages, sampling?} per line")
    gen.add_argument("--output", help="JSONL results, appended as they finish; a rerun skips done ids")
    gen.add_argument(
        "--chat", action="store_true", help="treat each prompt as a user message and apply the chat template"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON record per prompt")
    # A request's `speculative` opt-out is for servers; here --speculative sets the engine's.
    add_flags(
        gen, SamplingParams, title="sampling (unset knobs: the model's defaults)", skip=("speculative",)
    )
    add_flags(gen, EngineConfig, title="engine", skip=("context_policy",))
    gen.add_argument(
        "--context-policy",
        choices=CONTEXT_POLICIES,
        default=None,
        help="when a prompt does not fit the window (default: error)",
    )
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible server (see `jinfer serve --help`)", add_help=False
    )
    serve.set_defaults(func=None)

    conv = sub.add_parser("convert", help="write a jinfer (orbax) checkpoint from any supported model")
    conv.add_argument("src", help="HF directory, .gguf file or jinfer checkpoint")
    conv.add_argument("dst", help="output directory")
    conv.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="auto: weights as the source holds them (a GGUF's Q8_0 / Q4_x / Q5_x / Q4_K / Q5_K / Q6_K "
        "blocks stay so); int8: float matrices quantized to int8 per output channel; none: all float "
        "(default: auto)",
    )
    conv.set_defaults(func=_convert)
    _finetune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server parses its own (many) options
        from jinfer_serve.main import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        # RequestError, CheckpointError, TokenizerError and UnsupportedModelError are ValueErrors.
        print(f"jinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
