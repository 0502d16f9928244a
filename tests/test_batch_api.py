"""OpenAI's Files and Batch APIs on a real server with the official client: a batch's lines answered
exactly as the same requests sent alone, malformed lines as error lines, cancelling, and a server
killed mid-batch that resumes it from its batch directory on restart."""

import io
import json
import signal
import time

import httpx
import openai
import pytest
from test_server import AUTH, KEY, TINY_OPTIONS, running_server

LINES = 24


def _line(i: int, url: str = "/v1/completions") -> dict:
    body = {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": 60, "ignore_eos": True}
    body |= {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i}  # greedy and seeded
    return {"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}


def _upload(client, lines: list) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("batch.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def _wait(client, batch_id, until=("completed", "failed", "cancelled"), timeout=300):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def _records(client, file_id) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama_gqa_untied")[0]


def test_a_batch_killed_mid_way_resumes_after_a_restart_and_answers_as_requests_alone(model, tmp_path):
    options = [*TINY_OPTIONS, "--batch-dir", str(tmp_path / "batches"), "--max-queue", "8"]
    malformed = [
        "{not json",
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    ]
    with running_server(model, *options) as (base, proc):
        client = _client(base)
        batch = client.batches.create(
            input_file_id=_upload(client, [_line(i) for i in range(LINES)] + malformed),
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"run": "restart"},
        )
        deadline = time.monotonic() + 300
        while (progress := client.batches.retrieve(batch.id)).request_counts.completed < 4:
            assert progress.status == "in_progress" and time.monotonic() < deadline, progress
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no drain: lines in flight are lost and run again
        proc.wait()
    before = progress.request_counts.completed
    assert before < LINES, "the batch finished before the kill: make its lines longer"
    with running_server(model, *options) as (base, _):
        client = _client(base)
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.metadata == {"run": "restart"}
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            LINES + 2,
            LINES,
            2,
        )
        records = _records(client, done.output_file_id)
        assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(LINES))
        for record in records:
            i = int(record["custom_id"].split("-")[1])
            alone = httpx.post(base + "/v1/completions", json=_line(i)["body"], headers=AUTH).json()
            answer = record["response"]["body"]
            assert record["response"]["status_code"] == 200 and answer["object"] == "text_completion"
            assert answer["choices"][0]["text"] == alone["choices"][0]["text"], record["custom_id"]
        errors = _records(client, done.error_file_id)
        assert sorted((e["custom_id"] or "", e.get("line")) for e in errors) == [
            ("", LINES + 1),
            ("no-body", None),
        ]
        assert all(e["response"] is None and e["error"]["message"] for e in errors)


def test_files_and_batches_are_listed_cancelled_deleted_and_refused_in_openai_shape(model, tmp_path):
    options = [*TINY_OPTIONS, "--batch-dir", str(tmp_path / "batches")]
    with running_server(model, *options) as (base, _):
        client = _client(base)
        file_id = _upload(client, [_line(i) for i in range(LINES)])
        assert client.files.retrieve(file_id).purpose == "batch" and file_id in {
            f.id for f in client.files.list()
        }
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        cancelled = _wait(client, batch.id)
        assert cancelled.status == "cancelled" and cancelled.request_counts.completed < LINES
        assert client.batches.list().data[0].id == batch.id

        def create(file=file_id, endpoint="/v1/completions", window="24h"):
            return client.batches.create(input_file_id=file, endpoint=endpoint, completion_window=window)

        upload = lambda purpose: client.files.create(file=("x", io.BytesIO(b"{}")), purpose=purpose)
        refusals = [
            (openai.BadRequestError, lambda: create(endpoint="/v1/embeddings")),
            (openai.BadRequestError, lambda: create(window="1h")),
            (openai.NotFoundError, lambda: create(file="file-x")),
            (openai.NotFoundError, lambda: client.batches.retrieve("batch_nothere")),
            (openai.NotFoundError, lambda: client.files.content("file-../../etc")),
            (openai.BadRequestError, lambda: upload("fine-tune")),
        ]
        for error, call in refusals:
            with pytest.raises(error) as caught:
                call()
            assert caught.value.body["message"]
        assert client.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).files.list()
