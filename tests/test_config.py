"""ModelConfig from Hugging Face configs in transformers 4 and 5 layouts, and from GGUF metadata."""

import pytest

from jinfer.config import ModelConfig, RopeConfig

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
    a, b = ModelConfig.from_hf(LLAMA31_V4), ModelConfig.from_hf(v5)
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
    assert ModelConfig.from_hf(base).sliding_windows == (0, 0, 16, 16)
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert ModelConfig.from_hf({**base, "layer_types": types}).sliding_windows == (16, 0, 16, 0)
    assert ModelConfig.from_hf({**base, "use_sliding_window": False}).sliding_windows == (0, 0, 0, 0)
    assert ModelConfig.from_hf(base).qkv_bias and not ModelConfig.from_hf(base).qk_norm


def test_config_round_trips_through_dict():
    cfg = ModelConfig.from_hf(LLAMA31_V4)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(ModelConfig.from_dict(cfg.to_dict()))


def test_gguf_metadata_of_the_embedded_model(smollm2_path):
    from jinfer.weights import gguf_metadata, read_gguf

    reader = read_gguf(smollm2_path)
    cfg = ModelConfig.from_gguf(gguf_metadata(reader), {t.name for t in reader.tensors})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.vocab_size == 49152
    assert cfg.eos_token_ids == (2,)


def test_every_serve_preset_resolves_to_a_valid_engine_config():
    """Unknown options and invalid values would raise here, not when someone starts the server."""
    import glob

    from jinfer.config import EngineConfig
    from serve.main import ENGINE_OPTIONS, build_parser, resolve_options

    engines = {}
    for preset in sorted(glob.glob("configs/*.toml")):
        options = resolve_options(build_parser().parse_args(["--config", preset]))
        engines[preset] = EngineConfig(
            **{k: options[k] for k in (*ENGINE_OPTIONS, "prefill_buckets") if k in options}
        )
    assert engines["configs/smollm2.toml"].mixed_prefill_tokens == 0  # `make serve`: throughput preset
    assert (
        engines["configs/smollm2.toml"].packed_weights and not engines["configs/qwen2.5.toml"].packed_weights
    )
    flags = ["--config", "configs/smollm2.toml", "--packed-weights", "off"]
    assert resolve_options(build_parser().parse_args(flags))["packed_weights"] is False
    with pytest.raises(ValueError, match="packed_weights must be true or false"):
        EngineConfig(packed_weights="yes")
    latency = engines["configs/smollm2-latency.toml"]
    assert latency.decode_steps == 1 and latency.packed_weights
    # Carried prompt chunks fill the kernel's first 8 columns; past them each column costs.
    assert [latency.mixed_chunk_len(busy) for busy in (1, 4, 8)] == [7, 4, 4]
    # XLA's products cost whole 8-column tiles: chunks fill them.
    on_xla = EngineConfig(mixed_prefill_tokens=4)
    assert [on_xla.mixed_chunk_len(busy) for busy in (1, 4, 8)] == [7, 4, 8]
