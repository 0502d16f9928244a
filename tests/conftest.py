"""Shared fixtures: tiny reference models built once per session, 8 virtual CPU devices."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """family -> (directory with config.json + safetensors + tokenizer, the transformers model)."""
    built = {}

    def get(family: str):
        if family not in built:
            directory = str(tmp_path_factory.mktemp(family))
            built[family] = (directory, tiny.build_hf_model(family, directory))
        return built[family]

    return get


@pytest.fixture(scope="session")
def smollm2_path():
    from jinfer.loading import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm():
    import jinfer

    return jinfer.LLM(max_slots=4, max_seq_len=512)  # the embedded model; a small cache keeps tests quick
