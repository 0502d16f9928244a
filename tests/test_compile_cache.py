"""The persistent compilation cache: a restarted server loads every program it compiled the first
time, and answers the same."""

import contextlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
from test_server import _free_port, terminate

import jinfer
from jinfer import compile_cache, program_store
from jinfer.config import EngineConfig
from jinfer.inputs import Program

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


@pytest.fixture
def keep_executables(monkeypatch):
    monkeypatch.setenv(program_store.KEEP, "1")  # off for the rest of the suite (conftest)


def test_a_restarted_server_loads_every_program_and_answers_the_same(tiny_model, tmp_path, keep_executables):
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


GENERATE = """
import json, sys
import jinfer
from jinfer.compile_cache import tally
llm = jinfer.LLM(sys.argv[1], compile_cache=sys.argv[2], max_slots=2, max_seq_len=64,
                 max_num_batched_tokens=64, page_size=16)
greedy = jinfer.SamplingParams(max_tokens=8, temperature=0)
if sys.argv[3] == "use-first":  # the steps built by calls (through JAX's cache), then the warm-up
    llm.generate(["Hello there"], greedy)
llm.engine.warmup()
built = tally()
tokens = llm.generate(["Hello there"], greedy)[0].token_ids
print(json.dumps({"tokens": tokens, "programs": built.programs, "loaded": built.loaded}))
"""


def _generate_in_a_process(model: str, folder, order: str = "warm-first") -> dict:
    command = [sys.executable, "-c", GENERATE, model, str(folder), order]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_executables_are_kept_whole_even_where_jax_cache_holds_them(tiny_model, tmp_path, keep_executables):
    """A restart loads each program's executable kept whole (no tracing), and it runs. The second
    process finds every program in JAX's own cache but none kept: what it keeps must still be a
    fresh compile (one JAX loaded from its cache serializes without some of its functions)."""
    model = tiny_model("llama_gqa_untied")[0]
    first = _generate_in_a_process(model, tmp_path)
    assert first["loaded"] == 0
    shutil.rmtree(tmp_path / program_store.SUBFOLDER)  # JAX's cache stays
    again = _generate_in_a_process(model, tmp_path)
    kept = sorted((tmp_path / program_store.SUBFOLDER).glob("*.executable"))
    restarted = _generate_in_a_process(model, tmp_path)
    assert kept and restarted["loaded"] == restarted["programs"] == first["programs"]
    assert first["tokens"] == again["tokens"] == restarted["tokens"]


def test_steps_built_before_the_warm_up_are_not_kept(tiny_model, tmp_path, keep_executables):
    """An engine used before its warm-up has the steps it called built through JAX's cache (the
    second process loads them from it); the warm-up gets those back from JAX's memory and keeps
    none of them (they may not serialize whole), only the steps it compiled itself. A later start
    loads what was kept and runs it, and keeps the rest."""
    model = tiny_model("llama_gqa_untied")[0]
    kept = lambda: sorted((tmp_path / program_store.SUBFOLDER).glob("*.executable"))
    used_first = [_generate_in_a_process(model, tmp_path, "use-first") for _ in range(2)]
    kept_by_them = len(kept())
    warmed = _generate_in_a_process(model, tmp_path)
    restarted = _generate_in_a_process(model, tmp_path)
    assert kept_by_them < len(kept()) and restarted["loaded"] == restarted["programs"]
    assert used_first[0]["tokens"] == used_first[1]["tokens"] == warmed["tokens"] == restarted["tokens"]


def test_a_second_engine_of_the_same_layout_traces_nothing(tiny_model, monkeypatch, keep_executables):
    options = dict(max_slots=2, max_seq_len=64, max_num_batched_tokens=64, page_size=16)
    model = tiny_model("qwen2_bias_tied")[0]
    first = jinfer.LLM(model, **options)
    first.engine.warmup()
    loads = []
    load = program_store.ProgramStore.load
    monkeypatch.setattr(program_store.ProgramStore, "load", lambda *a: loads.append(load(*a)) or loads[-1])
    lowered = []
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: lowered.append(a))
    second = jinfer.LLM(model, **options)
    second.engine.warmup()
    assert len(loads) == len(second.engine.steps.programs) and all(loads) and lowered == []
    prompts, greedy = ["one two three", "four"], jinfer.SamplingParams(max_tokens=6, temperature=0)
    assert [c.token_ids for c in second.generate(prompts, greedy)] == [
        c.token_ids for c in first.generate(prompts, greedy)
    ]


def test_what_keys_a_kept_executable(keep_executables):
    class Steps:
        model, draft_model, layout, vocab_size, processors = "model", None, "layout", 10, ()
        mesh = "mesh"

    store = program_store.ProgramStore.for_steps(Steps())
    program, other = (Program("decode", rows, 64, 0, 0, False) for rows in (1, 4))
    args = (np.zeros((4, 2), np.float32), None)
    assert store.path(program, args) == store.path(program, (np.ones((4, 2), np.float32), None))
    assert store.path(program, args) != store.path(other, args)
    assert store.path(program, args) != store.path(program, (np.zeros((4, 3), np.float32), None))
    assert store.path(program, args) != store.path(program, (np.zeros((4, 2), np.int32), None))
    elsewhere = Steps()
    elsewhere.layout = "another layout"
    assert program_store.ProgramStore.for_steps(elsewhere).path(program, args) != store.path(program, args)
    elsewhere.processors = ("a processor",)  # user code the key cannot read: nothing kept
    assert program_store.ProgramStore.for_steps(elsewhere) is None
