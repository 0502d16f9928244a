"""Pause and resume (`jinfer.residency.pause`): no admission while paused; the requests in flight
finish, are aborted, or are held with their KV and go on after resume exactly as if never held;
update_weights between the two; offline and over HTTP."""

import dataclasses
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from test_server import AUTH, TINY_OPTIONS, running_server

import jinfer

GREEDY = jinfer.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = dataclasses.replace(GREEDY, temperature=0.9, seed=5)
PROMPTS = [list(range(3, 40)), [5, 17, 42, 99, 3]]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=4, max_seq_len=256)


class Sink:
    def __init__(self):
        self.tokens, self.finish_reason = [], None

    def __call__(self, output):
        self.tokens += output.token_ids
        self.finish_reason = output.finish_reason or self.finish_reason


def _submit(llm, prompt, sampling) -> Sink:
    sink = Sink()
    llm.engine.submit(llm.preparer.prepare(prompt, sampling=sampling), sink)
    return sink


def _steps(llm, n: int) -> None:
    for _ in range(n):
        llm.engine.step()


def test_kept_requests_hold_their_place_and_go_on_as_if_never_paused(llm):
    alone = [c.token_ids for c in llm.generate(PROMPTS, [GREEDY, SEEDED])]
    late_alone = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    sinks = [_submit(llm, p, s) for p, s in zip(PROMPTS, [GREEDY, SEEDED], strict=True)]
    _steps(llm, 3)
    llm.pause("keep")
    held = [list(s.tokens) for s in sinks]
    assert all(0 < len(h) < GREEDY.max_tokens for h in held)
    late = _submit(llm, PROMPTS[1], GREEDY)
    _steps(llm, 5)
    assert [s.tokens for s in sinks] == held and late.tokens == []  # nothing steps, nothing admitted
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([PROMPTS[0]], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.sleep(1)  # it would free the KV cache the held requests need
    llm.resume()
    llm.engine.run_until_idle()
    assert [s.tokens for s in sinks] == alone
    assert late.tokens == late_alone


def test_finish_and_abort(llm):
    want = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    running = _submit(llm, PROMPTS[0], GREEDY)
    _steps(llm, 2)
    llm.pause("finish")  # returns once the running request is done
    assert running.tokens == want and running.finish_reason == "length"
    waiting = _submit(llm, PROMPTS[0], GREEDY)
    _steps(llm, 3)
    assert waiting.tokens == []
    llm.resume()
    llm.engine.run_until_idle()
    assert waiting.tokens == want
    cut = _submit(llm, PROMPTS[0], GREEDY)
    _steps(llm, 2)
    llm.pause("abort")
    assert cut.finish_reason == "abort" and len(cut.tokens) < GREEDY.max_tokens
    llm.resume()
    with pytest.raises(ValueError, match="mode"):
        llm.pause("later")


def test_weights_updated_while_requests_are_kept(llm, tiny_model):
    """The research loop's weight sync: pause (keep), update_weights, resume. The held request
    goes on; a request after it runs on the new weights only: the pages the held one leaves in
    the prefix cache (computed partly by the old weights) are never found for it."""
    long = list(range(3, 100))  # a full page (64 positions) the prefix cache keeps
    before = llm.generate([long], GREEDY)[0].token_ids
    rng = np.random.default_rng(3)
    noise = lambda w: 0.05 * rng.standard_normal(w.shape).astype(w.dtype)
    new = jax.tree.map(lambda w: np.asarray(w) + noise(w), llm.params)
    old = jax.tree.map(np.asarray, llm.params)
    kept = _submit(llm, long, dataclasses.replace(GREEDY, max_tokens=40))  # fills a second page
    _steps(llm, 1)
    llm.pause("keep")
    assert len(kept.tokens) < 128 - len(long)  # its second page fills after the update
    llm.update_weights(new)
    llm.resume()
    llm.engine.run_until_idle()
    assert kept.finish_reason == "length" and len(kept.tokens) == 40
    # The held request's continuation, twice: the second finds the first's pages (computed by the
    # new weights), never the held request's second page.
    continued = long + kept.tokens
    hits = llm.engine.kv.hits
    twice = [llm.generate([continued], GREEDY)[0].token_ids for _ in range(2)]
    assert llm.engine.kv.hits > hits
    llm.engine.kv.pool.forget()
    assert twice == [llm.generate([continued], GREEDY)[0].token_ids] * 2 and twice[0] != before
    llm.update_weights(old)
    assert llm.generate([long], GREEDY)[0].token_ids == before


def test_pause_and_resume_over_http(tiny_model):
    """POST /pause (behind the API key) answers once the pause holds; /health says paused; a
    request sent meanwhile waits, and after POST /resume gets the answer it gets unpaused."""
    with running_server(tiny_model("llama_gqa_untied")[0], *TINY_OPTIONS) as (base, _):
        post = lambda path, body=None: httpx.post(base + path, json=body, headers=AUTH, timeout=60)
        ask = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        want = post("/v1/completions", ask).json()["choices"][0]["text"]
        assert httpx.post(base + "/pause", json={"mode": "keep"}).status_code == 401
        assert post("/pause", {"mode": "later"}).status_code == 400
        assert post("/pause", {"mode": "finish"}).json() == {"status": "paused", "mode": "finish"}
        assert httpx.get(base + "/health").json() == {"status": "paused", "mode": "finish"}
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(post("/v1/completions", ask)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and not answers  # queued, not admitted
        assert post("/resume").json() == {"status": "ready"}
        waiting.join(60)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == want
        assert httpx.get(base + "/health").json()["status"] == "ok"
