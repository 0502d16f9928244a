"""One model served by several processes (jinfer.cluster): real processes on loopback, two CPU
devices each, against one process (this one) on four devices; and what a dead process does."""

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
import pytest
from test_server import _free_port

import jinfer
from jinfer.cluster import decode, encode
from jinfer.config import EngineConfig
from jinfer.inputs import DraftPlan, Program, neutral_inputs
from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.state import pack_piece, pack_pieces

# The server's serving defaults, spelled out so that the in-process reference runs the same engine.
# Few programs to compile (one piece bucket, two attention buckets): a cluster's
# processes compile each one at the same time, on two cores.
ENGINE = {
    "max_slots": 2,
    "max_seq_len": 128,
    "page_size": 16,
    "max_num_batched_tokens": 64,
    "decode_steps": 1,
}
PROMPTS = ["Once upon a time", "The capital of France is"]
REPEATING = "red green blue, red green blue, red green blue, red green blue"  # n-gram drafts from the start
GREEDY = {"max_tokens": 12, "temperature": 0.0}
SEEDED = {"max_tokens": 12, "temperature": 1.0, "seed": 7}


def _flags(options: dict) -> list[str]:
    flags = []
    for name, value in options.items():
        value = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        flags += ["--" + name.replace("_", "-"), value]
    return flags


def _start(
    command: list[str], rank: int, coordinator: str, mesh: tuple[int, int], log_dir, extra=None
) -> subprocess.Popen:
    flags = _flags(ENGINE | {"mesh_data": mesh[0], "mesh_model": mesh[1]} | (extra or {}))
    flags += ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(rank)]
    log = open(log_dir / f"process-{rank}.log", "w")  # noqa: SIM115 - the process owns it
    env = os.environ | {"JAX_NUM_CPU_DEVICES": "2"}
    cmd = [sys.executable, "-m", "jinfer.cli", *command, *flags]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _logs(log_dir) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(log_dir.glob("*.log")))


@contextlib.contextmanager
def serving(model: str, mesh: tuple[int, int], log_dir, timeout: float = 300, extra=None):
    """Two `jinfer serve` processes, one cluster (`extra`: engine options beyond ENGINE); yields
    (base URL, [leader, follower])."""
    port, coordinator = _free_port(), f"127.0.0.1:{_free_port()}"
    command = ["serve", "--model", model, "--port", str(port), "--served-model-name", "tiny"]
    procs = [_start(command, rank, coordinator, mesh, log_dir, extra) for rank in (0, 1)]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert all(p.poll() is None for p in procs), "a process exited:\n" + _logs(log_dir)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the cluster did not become ready:\n" + _logs(log_dir)
            time.sleep(0.3)
        yield base, procs
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _settled_processes(base: str, timeout: float = 15) -> list[dict]:
    """/health's processes once every follower's heartbeat has counted all the leader's calls."""
    deadline = time.monotonic() + timeout
    while True:
        processes = httpx.get(base + "/health").json()["processes"]
        if all(p["calls"] == processes[0]["calls"] for p in processes):
            return processes
        assert time.monotonic() < deadline, processes
        time.sleep(0.2)


def _reference(model: str, mesh: tuple[int, int]) -> dict[str, list[str]]:
    llm = jinfer.LLM(model, mesh_data=mesh[0], mesh_model=mesh[1], **ENGINE)
    assert len(llm.engine.mesh.devices.flat) == 4
    return {
        name: [c.text for c in llm.generate([*PROMPTS, REPEATING], SamplingParams(**knobs))]
        for name, knobs in (("greedy", GREEDY), ("seeded", SEEDED))
    }


# ------------------------------------------------------------------------------- messages
def _assert_same_arrays(sent, got):
    assert type(got) is type(sent)
    for a, b in zip(jax.tree.leaves(sent), jax.tree.leaves(got), strict=True):
        assert np.asarray(b).dtype == np.asarray(a).dtype
        np.testing.assert_array_equal(b, a)


def test_a_call_survives_its_message_bit_for_bit():
    knobs = SamplingArrays.from_params([SamplingParams(temperature=0.7, top_k=5).resolve()], [2**32 - 3])
    flags = {"slot": 1, "start": 32, "length": 9, "last": True, "generated": 2, "min_tokens": 3}
    tokens = np.arange(64, dtype=np.int32)
    piece = pack_piece(tokens, **flags, bias={5: -1.5}, stop_ids=(7,), sampling=knobs, vocab=100)
    chunk = pack_pieces([piece], 2, 64, vocab=100)
    allowed = np.full((2, 4), -1, np.int32)
    allowed[1, 2] = 12345
    inputs = neutral_inputs(2).replace(
        steps=np.array([1, 0], np.int32), deferred=np.array([False, True]), allowed=allowed
    )
    program = Program("prefill", 2, chunk=128, feeds_draft=False)
    verb, (back_program, back_inputs, back_chunk) = decode(encode("dispatch", (program, inputs, chunk)))
    assert verb == "dispatch" and {back_program: "a key"}[program] == "a key"
    assert back_inputs.plan is None and back_inputs.want_logprobs.shape == ()
    _assert_same_arrays(inputs, back_inputs)
    _assert_same_arrays(chunk, back_chunk)
    assert decode(encode("dispatch", (program, inputs.replace(allowed=None), None)))[1][1].allowed is None
    verifying = neutral_inputs(2, kinds=6, lengths=5, plan=True)
    verifying = verifying.replace(plan=verifying.plan.replace(drafting=np.array([True, False])))
    verify = Program("verify", 2, 64, drafts=8)
    _, (_, back_verifying, _) = decode(encode("dispatch", (verify, verifying, None)))
    assert isinstance(back_verifying.plan, DraftPlan)
    _assert_same_arrays(verifying, back_verifying)
    assert decode(encode("reset", ())) == ("reset", ())


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"coordinator": "nohost"}, "HOST:PORT"),
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": 2, "process_id": 2}, "process_id"),
        ({"follower_timeout_s": 0.1}, "follower_timeout_s"),
    ],
)
def test_cluster_settings_are_checked(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(**options)


# ------------------------------------------------------------------------ real processes
@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("smollm2_like")[0]  # 6 query / 2 kv heads: padded to divide the model axis


@pytest.fixture(scope="module")
def reference(model):
    """mesh -> {"greedy" | "seeded": the completions of PROMPTS and REPEATING by one process on four
    devices}."""
    return functools.cache(lambda mesh: _reference(model, mesh))


@pytest.fixture(scope="module", params=[(1, 4), (2, 2)], ids=["model4", "data2xmodel2"])
def cluster(request, model, tmp_path_factory):
    """A leader and a follower serving the model over a mesh of their four devices; the tests of a
    mesh end with one that kills a process."""
    log_dir = tmp_path_factory.mktemp("cluster")
    with serving(model, request.param, log_dir) as (base, procs):
        yield request.param, base, procs, log_dir


def test_two_processes_serve_what_one_process_on_four_devices_serves(cluster, reference):
    mesh, base, _, _ = cluster
    expected = reference(mesh)
    warm = _settled_processes(base)
    assert [p["process"] for p in warm] == [0, 1] and all(p["compiled_programs"] > 0 for p in warm)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    complete = lambda prompt, **knobs: client.completions.create(model="tiny", prompt=prompt, **knobs)
    for name, knobs in (("greedy", GREEDY), ("seeded", SEEDED)):
        want = expected[name][: len(PROMPTS)]
        assert [complete(p, **knobs).choices[0].text for p in PROMPTS] == want, name
        streams = [complete(p, stream=True, **knobs) for p in PROMPTS]  # both run at once, in two slots
        streamed = ["".join(chunk.choices[0].text for chunk in stream) for stream in streams]
        assert streamed == want, name
    after = _settled_processes(base)
    compiles = lambda processes: [p["compiled_programs"] for p in processes]
    assert compiles(after) == compiles(warm), "a process compiled after its warm-up"


def test_a_dead_process_is_noticed(cluster, model, tmp_path):
    """Over model 4: a dead leader ends its follower. Over data 2 x model 2: a follower killed
    mid-stream ends the stream with an error event, the leader answers 503, and starting both
    processes again serves again."""
    mesh, base, (leader, follower), log_dir = cluster
    if mesh == (1, 4):
        leader.kill()
        killed = time.monotonic()
        assert follower.wait(timeout=30) != 0 and time.monotonic() - killed < 15, _logs(log_dir)
        return
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=100, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    follower.kill()
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="engine unavailable") as ended:
        for _ in stream:
            pass
    assert time.monotonic() - killed < 15
    assert follower.wait(timeout=5) == -signal.SIGKILL
    ready, health = httpx.get(base + "/ready"), httpx.get(base + "/health")
    assert ready.status_code == 503 and health.status_code == 503
    assert health.json()["error"] in str(ended.value)  # the same reason: a collective with process 1 failed
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4)
    assert refused.value.status_code == 503
    leader.send_signal(signal.SIGTERM)
    assert leader.wait(timeout=30) == 0, _logs(log_dir)
    with serving(model, mesh, tmp_path) as (base, _):  # every process started again
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model="tiny", prompt=PROMPTS[1], **GREEDY)
        assert answer.choices[0].finish_reason == "length"


def test_a_batch_job_on_two_processes_writes_what_one_process_would(model, reference, tmp_path):
    mesh = (1, 4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    command = ["generate", "--model", model, "--input", str(prompts), "--output", str(out)]
    command += _flags({"max_tokens": GREEDY["max_tokens"], "temperature": 0})
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [_start(command, rank, coordinator, mesh, tmp_path) for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], _logs(tmp_path)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [records[str(i)]["text"] for i in range(len(PROMPTS))] == reference(mesh)["greedy"][: len(PROMPTS)]


def test_a_speculating_cluster_serves_what_one_process_decoding_serves(model, reference, tmp_path):
    """N-gram speculation over data 2 x model 2 (each verify call's draft plan crosses to the
    follower): the texts one process gives without speculation, greedy and seeded, with drafts
    checked; nothing compiled after the warm-up."""
    mesh = (2, 2)
    expected = reference(mesh)
    # Every draft verified: whether one pays on 4 processes sharing 2 cores is not this test's question.
    extra = {"speculative": "ngram", "num_draft_tokens": 3, "speculative_policy": "always"}
    with serving(model, mesh, tmp_path, extra=extra) as (base, _):
        warm = _settled_processes(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        complete = lambda prompt, **knobs: client.completions.create(model="tiny", prompt=prompt, **knobs)
        drafted = 0
        for name, knobs in (("greedy", GREEDY), ("seeded", SEEDED)):
            answers = [complete(p, **knobs) for p in (*PROMPTS, REPEATING)]
            assert [a.choices[0].text for a in answers] == expected[name], name
            drafted += sum(t["draft_tokens"] for a in answers for t in a.model_extra["jinfer"]["timings"])
        assert drafted > 0, "no draft was checked"
        compiles = lambda processes: [p["compiled_programs"] for p in processes]
        assert compiles(_settled_processes(base)) == compiles(warm), "a process compiled after its warm-up"
