"""Shared fixtures: tiny reference models built once per session, 8 virtual CPU devices."""

import hashlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nothing outside this machine is reached: litellm would fetch its model price list at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
# Compiled steps kept on disk between runs (JAX's persistent compilation cache, in a folder of its
# own per CPU and jax version: an XLA:CPU executable is built for the CPU it was compiled on). A
# first run compiles everything; later runs, and tests that build the same steps, load them.
# JINFER_TEST_XLA_CACHE=off compiles everything every time.
if os.environ.get("JINFER_TEST_XLA_CACHE", "on") != "off":
    from jinfer.kernels import cache_dir, cpu_signature

    _key = hashlib.sha256(f"{cpu_signature()} {jax.__version__}".encode()).hexdigest()[:12]
    _settings = {
        "jax_compilation_cache_dir": str(cache_dir() / f"xla-tests-{_key}"),
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_compilation_cache_max_size": 2 * 2**30,  # least recently used out past it
    }
    for _name, _value in _settings.items():
        jax.config.update(_name, _value)
        os.environ[_name.upper()] = str(_value)  # for the servers the tests start

# Executables kept whole (`jinfer.program_store`) are keyed by jinfer's sources and compiled fresh:
# every edit would recompile the whole suite. The tests of the store turn it on for themselves.
os.environ.setdefault("JINFER_KEEP_EXECUTABLES", "0")

import tiny  # noqa: E402

_MODULE_STARTED: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):
    _MODULE_STARTED.setdefault(location[0], time.monotonic())


def pytest_runtest_teardown(item, nextitem):
    """Under CI, each test file's wall time as it ends: a run cut short still shows where its time went."""
    module = item.location[0]
    if os.environ.get("CI") and (nextitem is None or nextitem.location[0] != module):
        seconds = time.monotonic() - _MODULE_STARTED[module]
        plugins = item.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():  # teardown's output is captured otherwise
                reporter.write_line(f"[{time.strftime('%H:%M:%S')}] {module}: {seconds:.0f} s")


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
