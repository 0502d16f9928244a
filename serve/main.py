"""`jinfer serve`: load a model, build the engine and the app, run uvicorn, drain on SIGTERM.

Every flag can also be set in a TOML file given with `--config` (same names, underscores);
flags on the command line win. The API key comes from --api-key, --api-key-file or JINFER_API_KEY.

SIGTERM (or Ctrl-C): /ready and new requests answer 503, running requests get up to
--drain-timeout seconds to finish, the rest end with finish_reason "abort", then the process exits.
A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import tomllib

import uvicorn

from jinfer.config import EngineConfig

log = logging.getLogger("jinfer.serve")

# How long an idle keep-alive connection stays open: longer than the 5 s for which the official
# openai client (httpx) reuses one. At uvicorn's default, also 5 s, the server can close a
# connection just as the client sends a request on it, and that request fails with a connection
# error (bench_serve, whose client does not retry, once failed so in its Poisson arrivals).
IDLE_CONNECTION_S = 30

# flag -> (type, default, help); the TOML file uses the same names.
SERVER_OPTIONS = {
    "model": (str, None, "HF directory, .gguf file or jinfer checkpoint (default: embedded SmolLM2)"),
    "host": (str, "127.0.0.1", "address to listen on"),
    "port": (int, 8000, "port to listen on"),
    "served_model_name": (str, None, "model name clients use (default: derived from --model)"),
    "api_key": (str, None, "require this bearer key (also --api-key-file, env JINFER_API_KEY)"),
    "api_key_file": (str, None, "file holding the API key"),
    "max_body_bytes": (int, 4 * 2**20, "largest request body accepted (413 beyond)"),
    "stream_max_tokens": (int, 1, "coalesce up to N tokens per SSE event"),
    "stream_max_delay_ms": (float, 0.0, "... or until M ms after the first buffered token"),
    "keepalive_s": (float, 15.0, "SSE keep-alive comment after this much silence"),
    "drain_timeout": (float, 30.0, "seconds running requests may finish after SIGTERM"),
    "log_level": (str, "info", "logging level"),
}


def _on_off(text: str) -> bool:
    if text.lower() in ("true", "on", "yes", "1"):
        return True
    if text.lower() in ("false", "off", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


ENGINE_OPTIONS = {
    "max_slots": (int, "concurrent sequences (slots)"),
    "max_seq_len": (int, "tokens per slot (prompt + output)"),
    "max_queue": (int, "waiting requests before 429"),
    "decode_steps": (int, "decode steps per device dispatch"),
    "prefill_token_budget": (int, "prompt tokens prefilled per engine iteration"),
    "mixed_prefill_tokens": (
        int,
        "prompt tokens carried by each decode dispatch while others stream (0: off)",
    ),
    "dtype": (str, "float32 | bfloat16 | float16"),
    "mesh_data": (int, "devices on the data axis"),
    "mesh_model": (int, "devices on the model axis"),
    "context_policy": (str, "error | truncate | drop_oldest"),
    "packed_weights": (
        _on_off,
        "true | false: a packed copy of the weights for faster CPU decode (float32, one device)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jinfer serve", description="OpenAI-compatible jinfer server")
    parser.add_argument("--config", help="TOML file with any of the options below")
    for name, (kind, _, text) in SERVER_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    for name, (kind, text) in ENGINE_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    parser.add_argument("--prefill-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    return parser


def resolve_options(args: argparse.Namespace) -> dict:
    """Defaults, then the TOML file, then command-line flags."""
    options = {name: default for name, (_, default, _) in SERVER_OPTIONS.items()}
    if args.config:
        with open(args.config, "rb") as f:
            from_file = tomllib.load(f)
        known = set(SERVER_OPTIONS) | set(ENGINE_OPTIONS) | {"prefill_buckets"}
        unknown = sorted(set(from_file) - known)
        if unknown:
            raise ValueError(f"{args.config}: unknown options {unknown}")
        options.update(from_file)
    options.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    return options


def _api_keys(options: dict) -> tuple[str, ...]:
    key = options.get("api_key") or os.environ.get("JINFER_API_KEY")
    if options.get("api_key_file"):
        with open(options["api_key_file"], encoding="utf-8") as f:
            key = f.read().strip()
    return (key,) if key else ()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before shutting down."""

    def __init__(self, config: uvicorn.Config, api):
        super().__init__(config)
        self.api = api
        self._drain_task = None

    def handle_exit(self, sig, frame) -> None:
        if self._drain_task is not None or not self.api.ready:
            return super().handle_exit(sig, frame)  # second signal, or nothing to drain: exit now
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.api.drain()
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = resolve_options(args)
        engine_options = {
            k: options[k] for k in (*ENGINE_OPTIONS, "prefill_buckets") if options.get(k) is not None
        }
        engine_config = EngineConfig(**engine_options)
        keys = _api_keys(options)
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"jinfer serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=options["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from jinfer.engine import Engine
    from jinfer.weights import default_model_path, load_model
    from serve.app import ServerSettings, build_app

    model_path = options["model"] or default_model_path()
    start = time.perf_counter()
    try:
        loaded = load_model(model_path)
        engine = Engine(loaded, engine_config)
    except (ValueError, OSError) as e:
        print(f"jinfer serve: error: {e}", file=sys.stderr)
        return 2
    name = options["served_model_name"] or os.path.basename(os.path.normpath(model_path)).removesuffix(
        ".gguf"
    )
    cfg = engine.config
    log.info(
        "model %s (%s, %d layers) loaded in %.1f s as '%s'",
        model_path,
        loaded.config.architecture,
        loaded.config.num_layers,
        time.perf_counter() - start,
        name,
    )
    log.info(
        "%d slots x %d tokens, KV cache %.0f MiB (%s), queue %d",
        cfg.max_slots,
        cfg.max_seq_len,
        engine.cache_bytes / 2**20,
        cfg.dtype,
        cfg.max_queue,
    )
    settings = ServerSettings(
        served_model_name=name,
        api_keys=keys,
        max_body_bytes=options["max_body_bytes"],
        stream_max_tokens=options["stream_max_tokens"],
        stream_max_delay_ms=options["stream_max_delay_ms"],
        keepalive_s=options["keepalive_s"],
        drain_timeout_s=options["drain_timeout"],
    )
    app, api = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=options["host"],
        port=options["port"],
        log_level=options["log_level"],
        timeout_graceful_shutdown=5,
        timeout_keep_alive=IDLE_CONNECTION_S,
        ws="websockets-sansio",
    )
    log.info(
        "listening on http://%s:%d (API key %s)", options["host"], options["port"], "on" if keys else "off"
    )
    DrainingServer(config, api).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
