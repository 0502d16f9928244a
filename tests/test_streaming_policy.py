"""The SSE writer's buffering and keep-alive policy, fed by hand-timed events (no engine)."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from tiny import train_tokenizer

from jinfer import SamplingParams, load_tokenizer
from jinfer.request import RequestOutput
from jinfer_serve.protocol import GenerationRequest, Submission
from jinfer_serve.responses import ResponseWriter, WriterContext
from jinfer_serve.settings import ServerConfig


class _Bridge:
    def __init__(self):
        self.cancelled = []

    def cancel(self, request_id):
        self.cancelled.append(request_id)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(directory)
    return load_tokenizer(directory)


def _api(tokenizer, **settings):
    """The completions writer over a stand-in engine (a tokenizer, no preparer: no log-probs)."""
    engine = SimpleNamespace(tokenizer=tokenizer, preparer=None)
    context = WriterContext(engine, _Bridge(), ServerConfig(**settings), "tiny", lambda: "fp_test")
    return ResponseWriter(context)


def _request():
    sampling = SamplingParams(max_tokens=8)
    return GenerationRequest(
        "completion", None, ["x"], None, sampling, 1, True, False, False, None, None, None
    )


async def _collect(api, schedule):
    """Feed (delay_s, text, finished) events and return the SSE frames written."""
    queue = asyncio.Queue()

    async def feed():
        for delay, text, finished in schedule:
            await asyncio.sleep(delay)
            event = RequestOutput(
                "r1", text, [1], finished=finished, finish_reason="length" if finished else None
            )
            event.metrics = {"prompt_tokens": 1, "completion_tokens": 3} if finished else None
            queue.put_nowait((0, event))

    feeder = asyncio.create_task(feed())
    frames = [frame async for frame in api.sse(_request(), queue, Submission(["r1"], [[1]], 0))]
    await feeder
    return frames


def _texts(frames):
    return [json.loads(f[6:])["choices"][0]["text"] for f in frames if f.startswith("data: {")]


def test_each_token_is_its_own_event_by_default_and_silence_sends_keepalives(tokenizer):
    api = _api(tokenizer, keepalive_s=0.05)
    frames = asyncio.run(_collect(api, [(0.0, "a", False), (0.2, "b", False), (0.0, "c", True)]))
    assert frames.count("\n\n") >= 2  # 0.2 s of silence, a blank line per 0.05 s
    assert _texts(frames) == ["a", "b", "c", ""]  # the finish comes as an empty chunk of its own
    assert json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert frames[-1] == "data: [DONE]\n\n"
    assert all(f.endswith("\n\n") and f.count("\n") == 2 for f in frames)
    assert api.bridge.cancelled == ["r1"]  # finished requests are cancelled as a no-op on the way out


def test_keepalives_are_invisible_to_the_openai_clients_parser(tokenizer):
    from openai._streaming import SSEDecoder

    api = _api(tokenizer, keepalive_s=0.05)
    frames = asyncio.run(_collect(api, [(0.15, "a", False), (0.15, "b", True)]))
    assert len(frames) > 5  # keep-alives between the events
    events = list(SSEDecoder().iter_bytes(f.encode() for f in frames))  # a network read per frame
    data = [e.data for e in events]
    assert data == [f[6:-2] for f in frames if f.startswith("data: ")]
    assert _texts(frames) == ["a", "b", ""]


def test_coalescing_by_token_count_and_delay(tokenizer):
    api = _api(tokenizer, stream_max_tokens=3, stream_max_delay_ms=300, keepalive_s=10)
    schedule = [(0.01, t, False) for t in "abcde"] + [(1.0, "f", False), (0.0, "g", True)]
    frames = asyncio.run(_collect(api, schedule))
    assert _texts(frames) == ["abc", "de", "fg", ""]  # "g" came within 300 ms of "f"
