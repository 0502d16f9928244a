"""The server's own settings (`ServerConfig`), declared like the engine's: each field is a
`jinfer serve` flag and a TOML key, with its default shown by `--help`."""

from __future__ import annotations

from dataclasses import dataclass

from jinfer.options import setting


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = setting(
        None, "HF directory, .gguf file or jinfer checkpoint; unset: the embedded SmolLM2"
    )
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on (bound before the model loads: a taken port fails at once)")
    served_model_name: str | None = setting(
        None, "the model name clients use; unset: the model's preset name, else its file or directory name"
    )
    api_key: str | None = setting(None, "require this bearer key (also --api-key-file or env JINFER_API_KEY)")
    api_key_file: str | None = setting(None, "file holding the API key")
    max_body_bytes: int = setting(4 * 2**20, "largest request body accepted (413 beyond)")
    stream_max_tokens: int = setting(1, "coalesce up to N tokens per SSE event")
    stream_max_delay_ms: float = setting(0.0, "... or until M ms after the first buffered token")
    keepalive_s: float = setting(15.0, "SSE keep-alive comment after this much silence")
    drain_timeout: float = setting(30.0, "seconds running requests may finish after SIGTERM")
    retry_after_s: int = setting(1, "Retry-After seconds sent with a 429 (queue full)")
    cors_origins: str | None = setting(
        None, "browser origins allowed to call the API, comma-separated ('*': any); unset: none (no CORS)"
    )
    web_ui: bool = setting(True, "serve the chat page at / (--no-web-ui: off)")
    batch_dir: str | None = setting(
        None, "directory of uploaded files and batches, resumed after a restart; unset: a temporary one"
    )
    batch_slots: int | None = setting(
        None,
        "the most Batch API lines running at once, over all batches; a dispatch beside few batch rows "
        "is quick, so a user arriving waits less for the one in flight; unset: an eighth of the slots",
    )
    max_file_bytes: int = setting(512 * 2**20, "largest file upload accepted (413 beyond)")
    log_level: str = setting("info", "logging level")

    def __post_init__(self):
        for name in (
            "port",
            "max_body_bytes",
            "stream_max_tokens",
            "retry_after_s",
            "max_file_bytes",
            "batch_slots",
        ):
            value = getattr(self, name)
            if name == "batch_slots" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "port" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("stream_max_delay_ms", "keepalive_s", "drain_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
