"""`jinfer generate --input/--output`: JSONL batch jobs that survive being killed."""

import json
import signal
import subprocess
import sys
import time

import pytest


def _run(args, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "jinfer.cli", "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _lines(path):
    if not path.exists():
        return []
    return [line for line in path.read_text().split("\n") if line.strip()]


@pytest.fixture
def jobs(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(200):
            if i % 10 == 3:
                entry = {"id": f"chat-{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
            else:
                sampling = {"max_tokens": 30 + i % 5, "ignore_eos": True}  # long enough to be interrupted
                entry = {"id": i, "prompt": f"Once upon a time {i}", "sampling": sampling}
            f.write(json.dumps(entry) + "\n")
    return prompts, tmp_path / "results.jsonl"


def test_killed_job_resumes_and_every_id_appears_exactly_once(tiny_model, jobs):
    directory, _ = tiny_model("llama_gqa_untied")
    prompts, results = jobs
    args = ["--model", directory, "--input", str(prompts), "--output", str(results)]
    args += ["--max-tokens", "32", "--max-seq-len", "128", "--max-slots", "2"]
    first = _run(args)
    deadline = time.monotonic() + 240
    while len(_lines(results)) < 20 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "the job ended before it could be interrupted: " + first.stderr.read()
    first.send_signal(signal.SIGKILL)
    first.wait()
    interrupted = len(_lines(results))
    assert 20 <= interrupted < 200

    second = _run(args)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err
    assert "tokens/s" in err  # the progress display
    records = [json.loads(line) for line in _lines(results)]
    ids = [r["id"] for r in records]
    assert len(ids) == 200 and len(set(ids)) == 200
    assert all(r["finish_reason"] in ("stop", "length") for r in records)
    by_id = {r["id"]: r for r in records}
    assert by_id[7]["completion_tokens"] == 30 + 7 % 5  # per-line sampling applied


def test_bad_lines_become_error_records(tiny_model, tmp_path):
    directory, _ = tiny_model("llama_gqa_untied")
    prompts, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "ok", "prompt": "hello"},
        {"id": "bad-sampling", "prompt": "hello", "sampling": {"temperature": -1}},
        {"id": "empty", "prompt": ""},
        {"id": "too-long", "prompt": list(range(100)), "sampling": {"max_tokens": 60}},
    ]
    raw = "".join(json.dumps(x) + "\n" for x in lines)
    raw += 'this line is not JSON\n{"prompt": "no id"}\n{"id": "number", "prompt": 42}\n'
    raw += '{"id": "odd-sampling", "prompt": "x", "sampling": {"temprature": 0}}\n'
    prompts.write_text(raw)
    run = _run(
        ["--model", directory, "--input", str(prompts), "--output", str(results), "--max-seq-len", "128"]
    )
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    records = {r["id"] if r["id"] is not None else r["line"]: r for r in map(json.loads, _lines(results))}
    assert records["ok"]["finish_reason"] in ("stop", "length")
    assert "temperature must be >= 0" in records["bad-sampling"]["error"]
    assert "prompt is empty" in records["empty"]["error"]
    assert "context window is 128 tokens" in records["too-long"]["error"]
    assert "line 5 is not JSON" in records[5]["error"] and "no 'id'" in records[6]["error"]
    assert "prompt must be a string or a list of token ids" in records["number"]["error"]
    assert "unknown sampling fields ['temprature']" in records["odd-sampling"]["error"]
    assert all(r["finish_reason"] == "error" for k, r in records.items() if k != "ok")
    rerun = _run(
        ["--model", directory, "--input", str(prompts), "--output", str(results), "--max-seq-len", "128"]
    )
    assert rerun.communicate(timeout=300)[1] and rerun.returncode == 0
    assert len(_lines(results)) == len(records) == 8  # a rerun skips every line already recorded
