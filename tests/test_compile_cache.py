"""The persistent compilation cache: a restarted server loads every program it compiled the first
time, and answers the same."""

import contextlib
import pathlib
import re
import subprocess
import sys
import time

import httpx
import jax
import pytest
from test_server import _free_port, terminate

from jinfer import compile_cache
from jinfer.config import EngineConfig

WARM_UP = re.compile(r"warm-up: [\d.]+ s; (\d+) programs in [\d.]+ s \((\d+) loaded from the compile cache")


def _start_answer_stop(model: str, folder, log_path) -> tuple[str, int, int]:
    """Start `jinfer serve` on `folder`, ask one greedy completion, stop it: the answer, and the
    warm-up's programs and how many of them came from the cache."""
    port = _free_port()
    command = [sys.executable, "-m", "jinfer.cli", "serve", "--model", model, "--port", str(port)]
    command += ["--max-slots", "2", "--max-seq-len", "128", "--page-size", "16"]
    command += ["--max-num-batched-tokens", "128", "--compile-cache", str(folder)]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        terminate(proc)
    programs, loaded = WARM_UP.search(log_path.read_text()).groups()
    return answer, int(programs), int(loaded)


def test_a_restarted_server_loads_every_program_and_answers_the_same(tiny_model, tmp_path):
    model = tiny_model("llama_gqa_untied")[0]
    folder = tmp_path / "programs"
    first, programs, loaded = _start_answer_stop(model, folder, tmp_path / "first.log")
    assert programs > 0 and loaded == 0  # an empty folder: everything compiled
    again, programs_again, loaded_again = _start_answer_stop(model, folder, tmp_path / "again.log")
    assert (programs_again, loaded_again) == (programs, programs)  # nothing compiled
    assert again == first


def test_the_folder_a_setting_names(tmp_path, monkeypatch):
    assert compile_cache.folder_for("off") is None
    assert compile_cache.folder_for(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path / "jinfer"))
    given = jax.config.jax_compilation_cache_dir  # the tests' own folder (conftest)
    assert compile_cache.folder_for("auto") == pathlib.Path(given)  # JAX's folder, when it has one
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        autos = [compile_cache.folder_for("auto") for _ in range(2)]
    finally:
        jax.config.update("jax_compilation_cache_dir", given)
    # One folder per jax version and CPU: an XLA:CPU executable runs only on the CPU it was built for.
    assert autos[0].parent == tmp_path / "jinfer" / "xla" and autos[0] == autos[1]


@pytest.mark.parametrize("setting", ["", 3])
def test_a_setting_that_names_no_folder_is_refused(setting):
    with pytest.raises(ValueError, match="compile_cache must be auto, off or a folder"):
        EngineConfig(compile_cache=setting)
