"""`jinfer serve`: bind the port, load the model, build the engine and the app, serve while the
engine warms up in the background, drain on SIGTERM.

Settings, lowest first: each field's default (`ServerConfig`; `EngineConfig` with the server's own
`SERVING_DEFAULTS` for streaming), the model's preset
(`jinfer/presets`, matched by model file name), the TOML file or preset named by `--config`, then
command-line flags. The API key comes from --api-key, --api-key-file or JINFER_API_KEY.

Start-up: the port is bound first (a taken port fails at once, before any loading); once the model
is loaded the server answers at once, `/ready` and generation requests with 503 until the warm-up
has compiled every step, then serving. SIGTERM (or Ctrl-C): /ready and new requests answer 503,
running requests get up to --drain-timeout seconds to finish, the rest end with finish_reason
"abort", then the process exits. A second signal exits at once. On several processes (--coordinator,
--num-processes, --process-id: `jinfer.cluster`) process 0 serves; the others bind no port, follow
its device calls and exit when it does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Any

import uvicorn

from jinfer.config import EngineConfig
from jinfer.options import add_flags, check_keys, given, preset_names, read_toml, typed

from .request_ids import LOG_FORMAT, tag_log_records
from .settings import ServerConfig

log = logging.getLogger("jinfer.serve")

# How long an idle keep-alive connection stays open: longer than the 5 s for which the official
# openai client (httpx) reuses one. At uvicorn's default, also 5 s, the server can close a
# connection just as the client sends a request on it, and that request fails with a connection
# error.
IDLE_CONNECTION_S = 30

# A server streams to people: a smaller token budget per iteration than offline, so prompts
# arriving while others stream stretch those streams' next token less. Decode dispatches keep
# EngineConfig's 4 steps (tokens reach a stream in bursts of up to 4; a row riding with prompt
# pieces takes one step): one user's time per token on the Q4_1 file was 10-23% shorter than
# at one step a dispatch. Measured on the embedded model, with reasons: docs/performance.md ("Serving"). The
# `throughput` preset goes back to EngineConfig's budget.
SERVING_DEFAULTS = {"max_num_batched_tokens": 256}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jinfer serve", description="OpenAI-compatible jinfer server")
    parser.add_argument(
        "--config",
        metavar="FILE|PRESET",
        help="a TOML file of these settings (names with underscores; `[sampling]`: the model's "
        f"sampling defaults), or a preset shipped with jinfer: {', '.join(preset_names())}",
    )
    add_flags(parser, ServerConfig, title="server")
    add_flags(parser, EngineConfig, title="engine", defaults=SERVING_DEFAULTS)
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a low-rank adapter (a PEFT or jinfer directory) under NAME, which a request's "
        "`model` picks (repeatable; max_loras grows to hold them all)",
    )
    parser.add_argument(
        "--logits-processor",
        action="append",
        default=[],
        metavar="[NAME=]MODULE:ATTRIBUTE",
        help="register a logits processor (a jinfer.inputs.RowProcessor, or a function returning one, "
        "e.g. jinfer.processors:no_repeat_ngram) under NAME or its own name; a request's extra_args "
        "select it with its parameters (repeatable; docs/research.md)",
    )
    return parser


def resolve_options(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig, dict[str, Any]]:
    """(server settings, engine settings, sampling defaults from --config) in the order above,
    the serving defaults (SERVING_DEFAULTS) standing in for EngineConfig's own."""
    from jinfer.loading import default_model_path
    from jinfer.presets import model_preset

    from_file = read_toml(args.config) if args.config else {}
    check_keys(from_file, args.config, ServerConfig, EngineConfig, extra=("model_file", "sampling"))
    chosen = {**from_file, **given(args, ServerConfig), **given(args, EngineConfig)}
    preset = model_preset(chosen.get("model") or default_model_path())
    merged = {**SERVING_DEFAULTS, **preset, **chosen}
    sampling = from_file.get("sampling", {})
    if not isinstance(sampling, dict):
        raise ValueError(f"{args.config}: [sampling] must be a table")
    return ServerConfig(**typed(merged, ServerConfig)), EngineConfig(**typed(merged, EngineConfig)), sampling


def api_keys(server: ServerConfig) -> tuple[str, ...]:
    key = server.api_key or os.environ.get("JINFER_API_KEY")
    if server.api_key_file:
        with open(server.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    return (key,) if key else ()


def peak_resident_bytes() -> float:
    """This process's peak resident memory (Linux's VmHWM; NaN where there is none)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return float("nan")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, so that a port in use is an error before anything is loaded."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that says when it listens and whose first SIGTERM/SIGINT drains the engine."""

    def __init__(self, config: uvicorn.Config, api, url: str):
        super().__init__(config)
        self.api, self.url = api, url
        self._drain_task = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info(
                "listening on %s (API key %s%s); /ready answers 503 until warm",
                self.url,
                "on" if self.api.api_keys else "off",
                f"; chat page: {self.url}/" if self.api.settings.web_ui else "",
            )

    def handle_exit(self, sig, frame) -> None:
        if self._drain_task is not None or not self.api.ready:
            return super().handle_exit(sig, frame)  # second signal, or nothing to drain: exit now
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.api.drain()
        self.should_exit = True


def served_name(server: ServerConfig, model_path: str) -> str:
    from jinfer.presets import model_preset

    if server.served_model_name:
        return server.served_model_name
    preset = model_preset(model_path).get("served_model_name")
    return preset or os.path.basename(os.path.normpath(model_path)).removesuffix(".gguf")


class StartError(Exception):
    """Why the server cannot start: printed as `jinfer serve: error: ...`, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            server, engine_config, sampling = resolve_options(args)
            keys = api_keys(server)
        except (ValueError, OSError) as e:
            raise StartError(e) from None
        logging.basicConfig(level=server.log_level.upper(), format=LOG_FORMAT)
        tag_log_records()
        adapters = _adapter_paths(args.lora)
        if len(adapters) > engine_config.max_loras:
            engine_config = dataclasses.replace(engine_config, max_loras=len(adapters))
        processors = _logits_processors(args.logits_processor)
        member, sock = _join_and_listen(server, engine_config)
        engine, model_path = _load_engine(server, engine_config, sampling, processors)
        _load_adapters(engine, adapters)
    except StartError as e:
        print(f"jinfer serve: error: {e}", file=sys.stderr)
        return 2
    if sock is None:
        log.info("process %d follows process 0's device calls", member.rank)
        return engine.follow()
    _serve(engine, server, model_path, keys, sock, adapters)
    if member is not None and engine.failure is not None:
        # A process of the cluster is gone, and a computation dispatched before that may wait on it
        # in a collective forever: the interpreter's teardown would wait with it. Tell the live
        # followers to stop, then leave without the teardown.
        member.stop()
        logging.shutdown()
        os._exit(0)
    return 0


def _join_and_listen(server: ServerConfig, engine_config: EngineConfig):
    """This process's cluster membership (None alone) and its listening socket (None for a
    follower: it serves no HTTP)."""
    from jinfer.cluster import join_cluster

    try:
        member = join_cluster(engine_config)  # before anything touches a device
    except (ValueError, RuntimeError) as e:
        raise StartError(f"cannot join the cluster: {e}") from None
    if member is not None and not member.leader:
        return member, None
    try:
        return member, bind(server.host, server.port)
    except OSError as e:
        raise StartError(f"cannot listen on {server.host}:{server.port}: {e.strerror or e}") from None


def _logits_processors(flags: list[str]) -> list:
    """--logits-processor flags, each found (`jinfer.processors.load`)."""
    from jinfer.processors import load

    try:
        return [load(flag) for flag in flags]
    except ValueError as e:
        raise StartError(f"--logits-processor {e}") from None


def _load_engine(server: ServerConfig, engine_config: EngineConfig, sampling: dict, processors=()):
    """The engine over the model the settings name (its sampling steps applying the logits
    `processors`), and that model's path."""
    from jinfer import compile_cache
    from jinfer.engine import Engine
    from jinfer.loading import default_model_path, load_model, placement_for

    model_path = server.model or default_model_path()
    start = time.perf_counter()
    try:
        compile_cache.use(engine_config.compile_cache)  # before anything compiles
        placement = placement_for(engine_config)
        loaded = load_model(model_path, quantization=engine_config.quantization, placement=placement)
        loaded.generation_defaults.update(sampling)
        engine = Engine(loaded, engine_config, processors)
    except (ValueError, OSError) as e:
        raise StartError(e) from None
    log.info(
        "model %s (%s, %d layers) loaded in %.1f s as '%s' (resident memory peak so far: %.0f MiB, "
        "weights and KV pool); sampling defaults %s",
        model_path,
        loaded.config.architecture,
        loaded.config.num_layers,
        time.perf_counter() - start,
        served_name(server, model_path),
        peak_resident_bytes() / 2**20,
        engine.preparer.sampling(None),
    )
    return engine, model_path


def _adapter_paths(flags: list[str]) -> dict[str, str]:
    """--lora NAME=PATH flags, each name once."""
    adapters = {}
    for flag in flags:
        name, _, path = flag.partition("=")
        if not name or not path or name in adapters:
            raise StartError(f"--lora {flag}: give NAME=PATH, each name once")
        adapters[name] = path
    return adapters


def _load_adapters(engine, adapters: dict[str, str]) -> None:
    from jinfer.formats.adapters import read_adapter

    for name, path in adapters.items():
        try:
            engine.load_adapter(name, read_adapter(path, engine.model_config))
        except (ValueError, OSError, RuntimeError) as e:
            raise StartError(f"--lora {name}={path}: {e}") from None
        log.info("adapter '%s' from %s", name, path)


def _serve(
    engine, server: ServerConfig, model_path: str, keys: tuple[str, ...], sock: socket.socket, adapters=None
) -> None:
    """Serve HTTP on `sock` until SIGTERM or SIGINT (drained: `DrainingServer`)."""
    from .app import build_app
    from .fingerprint import system_fingerprint

    # Hashing the model's files takes a while for a large model: done during the warm-up.
    fingerprint = lambda: system_fingerprint(engine, model_path)
    app, api = build_app(engine, server, served_name(server, model_path), keys, fingerprint)
    api.adapter_paths.update(adapters or {})
    config = uvicorn.Config(
        app,
        log_level=server.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=IDLE_CONNECTION_S,
        ws="websockets-sansio",
    )
    host = f"[{server.host}]" if ":" in server.host else server.host
    DrainingServer(config, api, f"http://{host}:{sock.getsockname()[1]}").run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
