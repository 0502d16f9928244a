"""ModelConfig from Hugging Face configs in transformers 4 and 5 layouts, and from GGUF metadata."""

import pytest

from jinfer.config import ModelConfig, RopeConfig
from jinfer.formats.hf import model_config as hf_config

LLAMA31_V4 = {  # transformers 4.x layout: top-level rope_theta, rope_scaling, torch_dtype
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
}


def test_transformers_4_and_5_layouts_agree():
    v5 = {k: v for k, v in LLAMA31_V4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5["dtype"] = "bfloat16"
    v5["rope_parameters"] = {**LLAMA31_V4["rope_scaling"], "rope_theta": 500000.0}
    a, b = hf_config(LLAMA31_V4), hf_config(v5)
    assert a == b
    assert a.rope == RopeConfig(
        theta=500000.0,
        kind="llama3",
        factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    assert a.head_dim == 128 and a.num_groups == 4 and a.eos_token_ids == (128001, 128008, 128009)


def test_qwen2_sliding_window_layers_follow_max_window_layers_or_layer_types():
    base = {
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 16,
        "use_sliding_window": True,
        "max_window_layers": 2,
    }
    assert hf_config(base).sliding_windows == (0, 0, 16, 16)
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert hf_config({**base, "layer_types": types}).sliding_windows == (16, 0, 16, 0)
    assert hf_config({**base, "use_sliding_window": False}).sliding_windows == (0, 0, 0, 0)
    assert hf_config(base).qkv_bias and not hf_config(base).qk_norm


def test_config_round_trips_through_dict():
    cfg = hf_config(LLAMA31_V4)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(ModelConfig.from_dict(cfg.to_dict()))


def test_gguf_metadata_of_the_embedded_model(smollm2_path):
    from jinfer.formats.gguf import gguf_metadata, model_config, read_gguf

    reader = read_gguf(smollm2_path)
    cfg = model_config(gguf_metadata(reader), {t.name for t in reader.tensors})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.vocab_size == 49152
    assert cfg.eos_token_ids == (2,)


def _resolve(*flags):
    from jinfer_serve.main import build_parser, resolve_options

    return resolve_options(build_parser().parse_args(list(flags)))


def test_every_preset_and_config_resolves_to_valid_settings():
    """Unknown options and invalid values would raise here, not when someone starts the server."""
    import glob

    from jinfer.config import EngineConfig
    from jinfer.options import preset_names

    sources = sorted(glob.glob("configs/*.toml")) + preset_names()
    assert "throughput" in sources and len(sources) >= 5
    resolved = {source: _resolve("--config", source) for source in sources}
    server, engine, _ = resolved["throughput"]
    assert engine == EngineConfig()  # the offline doors' defaults
    assert server.served_model_name == "smollm2-135m-instruct"  # from the embedded model's preset
    assert resolved["configs/qwen2.5.toml"][0].served_model_name == "qwen2.5-instruct"


def test_settings_resolve_defaults_then_model_preset_then_config_then_flags(tmp_path):
    from jinfer.config import EngineConfig
    from jinfer_serve.main import SERVING_DEFAULTS

    server, engine, sampling = _resolve()
    assert engine == EngineConfig(**SERVING_DEFAULTS) and engine.packed_weights is None  # auto
    assert engine.max_num_batched_tokens == 256  # a prompt stretches the streams' next tokens less
    assert server.served_model_name == "smollm2-135m-instruct" and server.port == 8000 and sampling == {}
    config = tmp_path / "x.toml"
    config.write_text('served_model_name = "mine"\nmax_slots = 4\n[sampling]\ntemperature = 0.5\n')
    flags = ("--config", str(config), "--max-slots", "2", "--packed-weights", "off")
    server, engine, sampling = _resolve(*flags)
    assert (server.served_model_name, engine.max_slots, engine.packed_weights) == ("mine", 2, False)
    assert sampling == {"temperature": 0.5}
    assert _resolve("--packed-weights", "auto")[1].packed_weights is None
    assert _resolve()[0].web_ui and not _resolve("--no-web-ui")[0].web_ui  # a plain bool's --no-x
    assert not _resolve("--web-ui", "off")[0].web_ui and not _resolve("--no-prefix-caching")[1].prefix_caching
    config.write_text("max_slotz = 4\n")
    with pytest.raises(ValueError, match=r"unknown options \['max_slotz'\]"):
        _resolve("--config", str(config))
    with pytest.raises(ValueError, match="packed_weights must be true or false or auto"):
        EngineConfig(packed_weights="yes")


def test_help_shows_every_setting_with_its_default(capsys):
    import dataclasses

    from jinfer.cli import build_parser
    from jinfer.config import EngineConfig
    from jinfer_serve.main import build_parser as serve_parser
    from jinfer_serve.settings import ServerConfig

    text = " ".join(serve_parser().format_help().split())  # argparse wraps to the terminal
    for cls in (ServerConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in text, f.name
    assert "(default: 2048)" in text and "(default: auto)" in text and "(default: 127.0.0.1)" in text
    assert "as fit (at least one piece) (default: 256)" in text  # the server's own default
    generate = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--max-tokens" in generate and "--seed" in generate
    assert "--temperature" in generate and "--max-slots" in generate and "--packed-weights" in generate


def test_prefill_dispatches_are_compiled_for_the_pieces_the_token_budget_holds():
    from jinfer.config import EngineConfig
    from jinfer.layout import resolve_layout

    model = ModelConfig("llama", 320, 64, 128, 2, 4, 2, 16)

    def pieces(**settings):
        config = EngineConfig(packed_weights=False, **settings)
        layout = resolve_layout(config, model, 1, cache_bytes_per_token=0, weight_bytes=0, available_bytes=0)
        return layout.piece_buckets

    assert pieces() == (1, 2, 4, 8)  # 512 tokens: eight pieces of 64
    assert pieces(max_num_batched_tokens=1000) == (1, 2, 4, 8, 15)
    assert pieces(max_num_batched_tokens=10) == (1,)  # at least one piece
    assert pieces(max_slots=1, max_seq_len=128) == (1, 2)  # never more than every slot's sequence
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_page_pool_is_sized_in_whole_pages_and_caps_the_sequence_length():
    from jinfer.config import EngineConfig
    from jinfer.layout import resolve_layout

    model = ModelConfig("llama", 320, 64, 128, 2, 4, 2, 16)
    per_token = 2 * 2 * 2 * 16 * 4

    def layout(**options):
        config = EngineConfig(packed_weights=False, **options)
        return resolve_layout(
            config, model, 1, cache_bytes_per_token=per_token, weight_bytes=0, available_bytes=2**30
        )

    auto = layout(max_slots=4, max_seq_len=1000, page_size=16)
    # A CPU's auto pool: max_seq_len x max_slots (at most 8) positions in whole pages, plus the sink.
    assert (auto.num_pages, auto.kv_cache_tokens, auto.max_pages) == (251, 4000, 63)
    asked = layout(max_slots=64, max_seq_len=1024, kv_cache_tokens=3000, page_size=32)
    assert (asked.kv_cache_tokens, asked.max_slots, asked.max_seq_len) == (3008, 64, 1024)
    small = layout(max_seq_len=1024, kv_cache_tokens=100, page_size=16)  # no sequence grows past the pool
    assert (small.kv_cache_tokens, small.max_seq_len, small.max_pages) == (112, 112, 7)
    sharded = layout(max_slots=4, max_seq_len=64, kv_cache_tokens=64, mesh_data=4)
    assert sharded.num_pages % 4 == 0 and sharded.kv_cache_tokens >= 64
    assert "KV pool 250 pages x 16 positions = 4000 tokens" in auto.describe_pool(per_token)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        EngineConfig(page_size=24)


def test_slots_follow_the_hardware_and_share_a_pool_sized_apart_from_them():
    from jinfer.config import EngineConfig
    from jinfer.layout import ACCELERATOR_SLOTS, CPU_SLOTS, resolve_layout, resolve_slots
    from jinfer.options import int_or_auto

    model = ModelConfig("llama", 320, 64, 128, 2, 4, 2, 16)

    def layout(**options):
        config = EngineConfig(packed_weights=False, page_size=16, **options)
        sizes = {"cache_bytes_per_token": 64, "weight_bytes": 0, "available_bytes": 2**30}
        return resolve_layout(config, model, 1, **sizes)

    auto = layout(max_seq_len=1000)
    # 32 slots (the few-column kernels' widest decode step), their pool what 8 full sequences fill.
    assert (auto.max_slots, auto.kv_cache_tokens) == (CPU_SLOTS, 8000) and CPU_SLOTS == 32
    assert auto.slot_buckets == (1, 4, 8, 16, 32)
    assert layout(max_slots="auto", max_seq_len=1000) == auto  # as a TOML file may say it
    assert layout(max_slots=8, max_seq_len=1000).slot_buckets == (1, 4, 8)
    assert layout(max_slots=2, max_seq_len=1000).kv_cache_tokens == 2000
    assert layout(max_slots=1, max_seq_len=1000).slot_buckets == (1,)
    assert layout(max_seq_len=1000, mesh_data=2).max_slots == 16  # every slot runs: 8 per shard
    assert resolve_slots(EngineConfig(), "gpu") == ACCELERATOR_SLOTS
    assert int_or_auto("auto") is None and int_or_auto("12") == 12


def test_decode_rows_ride_with_prompt_pieces_only_where_the_kernels_keep_their_bits():
    import dataclasses

    from jinfer.config import EngineConfig
    from jinfer.layout import resolve_layout

    model = ModelConfig("llama", 320, 64, 128, 2, 4, 2, 16)
    config = EngineConfig(packed_weights=False, page_size=16, decode_steps=1, max_seq_len=1000)
    sizes = {"cache_bytes_per_token": 64, "weight_bytes": 0, "available_bytes": 2**30}
    base = resolve_layout(config, model, 1, **sizes)
    kernels = dataclasses.replace(base, attention_kernel="cpu", packed_weights=True)
    assert kernels.mixed_rows == (8, 32) and kernels.mixed_bucket(5) == 8 and kernels.mixed_bucket(9) == 32
    assert dataclasses.replace(kernels, max_slots=4).mixed_rows == (4,)
    assert dataclasses.replace(kernels, decode_steps=4).mixed_rows == (8, 32)  # one step riding
    # Anywhere a decode row's bits could depend on the prompt columns beside it, or a dispatch
    # verifies drafts, decode rows keep a dispatch of their own.
    for other in (
        dict(packed_weights=False),  # XLA's dot
        dict(attention_kernel=None),  # XLA's einsums
        dict(attention_kernel="gpu"),
        dict(draft_tokens=2),
        dict(mesh_data=2),
    ):
        assert dataclasses.replace(kernels, **other).mixed_rows == (), other
