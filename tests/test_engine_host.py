"""The engine's host side against a fake device (`fake_device.FakeDevice`): dispatch, commit,
chunked prompts and prompts of several requests in one dispatch, preemption, the prefix cache,
deferred rows and recovery, each request's tokens worked out by hand. No device program runs:
these take seconds."""

import numpy as np
import pytest
from fake_device import FakeDevice, expected
from tiny import VOCAB

import jinfer

GREEDY = dict(temperature=0, ignore_eos=True)


def _engine_llm(tiny_model, **options):
    """An LLM over the tiny Llama whose engine dispatches to a fake device."""
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], **options)
    llm.engine.device = FakeDevice(llm.engine)
    return llm


def _prompts(count: int, seed: int, low: int = 3, high: int = 70) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, rng.randint(low, high)).tolist() for _ in range(count)]


def _generate(llm, prompts, max_tokens):
    sampling = [jinfer.SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    return llm.generate(prompts, sampling)


def _assert_exact(completions, max_tokens):
    for completion, n in zip(completions, max_tokens, strict=True):
        assert completion.finish_reason == "length", completion.error
        assert completion.token_ids == expected(completion.prompt_token_ids, n, VOCAB)


@pytest.mark.parametrize(
    "options",
    [
        dict(decode_steps=4, max_num_batched_tokens=512),
        dict(decode_steps=2, max_num_batched_tokens=128),
        dict(decode_steps=1, max_num_batched_tokens=64),
    ],
    ids=["budget-512", "budget-128", "one-piece-per-iteration"],
)
def test_a_crowd_larger_than_the_slots_gets_each_request_its_own_tokens(tiny_model, options):
    """Twelve requests through four slots: queued, prompts (up to 69 tokens) prefilled in pieces of
    several requests a dispatch, or chunked over several iterations, decoded several steps a
    dispatch, each stopping at its own max_tokens."""
    llm = _engine_llm(tiny_model, max_slots=4, max_seq_len=160, **options)
    prompts = _prompts(12, seed=1)
    max_tokens = np.random.RandomState(2).randint(1, 40, len(prompts)).tolist()
    _assert_exact(_generate(llm, prompts, max_tokens), max_tokens)
    counts = llm.engine.dispatch_counts
    assert counts.prefill_tokens == sum(map(len, prompts))
    kinds = {program.kind for program in llm.engine.device.calls}
    # Decode rows ride in the prompt pieces' dispatch, one step, when both run.
    assert llm.engine.layout.mixed_rows
    assert kinds == {"prefill", "decode", "mixed"}
    pieces = [program.rows for program in llm.engine.device.calls if program.kind == "prefill"]
    # The first dispatch takes a prompt into every slot, as far as the budget's pieces reach.
    assert pieces[0] >= min(4, options["max_num_batched_tokens"] // 64)


def test_preempted_requests_resume_exactly_and_prefix_hits_read_the_cached_pages(tiny_model):
    """A pool of 12 pages of 16 for four slots: requests are preempted and prefill their output
    again; prompts sharing a 48-token prefix find its pages. The fake model reads every position's
    hash through the block tables, so a wrong page or position would change the tokens."""
    llm = _engine_llm(
        tiny_model, max_slots=4, max_seq_len=160, max_num_batched_tokens=64, kv_cache_tokens=192, page_size=16
    )
    shared = _prompts(1, seed=3, low=48, high=49)[0]
    prompts = [shared + tail for tail in _prompts(6, seed=4, low=2, high=20)]
    max_tokens = [60] * len(prompts)
    _assert_exact(_generate(llm, prompts, max_tokens), max_tokens)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_no_decode_dispatch_is_sent_for_tokens_past_max_tokens(tiny_model):
    llm = _engine_llm(tiny_model, max_slots=4, max_seq_len=128, max_num_batched_tokens=64, decode_steps=4)
    device = llm.engine.device
    for max_tokens in (1, 2, 5, 16):
        device.calls.clear()
        _assert_exact(_generate(llm, _prompts(1, seed=max_tokens), [max_tokens]), [max_tokens])
        decodes = [p for p in device.calls if p.kind == "decode"]
        assert len(decodes) == -(-(max_tokens - 1) // 4), max_tokens


@pytest.mark.parametrize("steps", [4, 1], ids=["4-steps", "1-step"])
def test_constrained_rows_are_deferred_and_sampled_under_their_allowed_sets(tiny_model, steps):
    """A grammar's rows are fed by decode steps (in a dispatch of their own, or beside prompt
    pieces) but sampled by `sample` dispatches under their bitmask; an unconstrained neighbour's
    tokens are the fake model's own."""
    llm = _engine_llm(tiny_model, max_slots=4, max_seq_len=128, max_num_batched_tokens=64, decode_steps=steps)
    digits = jinfer.SamplingParams(max_tokens=12, regex="[0-9]{12}", **GREEDY)
    free = jinfer.SamplingParams(max_tokens=20, **GREEDY)
    prompts = _prompts(2, seed=7)
    held, plain = llm.generate(prompts, [digits, free])
    assert held.text.isdigit() and len(held.token_ids) <= 12
    assert plain.token_ids == expected(plain.prompt_token_ids, 20, VOCAB)
    kinds = [program.kind for program in llm.engine.device.calls]
    assert kinds.count("sample") == llm.engine.dispatch_counts.sample_dispatches > 0
    assert "mixed" in kinds  # the second prompt beside the first's row


@pytest.mark.parametrize("kind,nth,steps", [("decode", 2, 2), ("mixed", 1, 1)], ids=["decode", "mixed"])
@pytest.mark.parametrize("consumed", [False, True], ids=["cache-kept", "cache-consumed"])
def test_a_failing_dispatch_fails_its_requests_and_the_engine_serves_on(
    tiny_model, consumed, kind, nth, steps
):
    """A decode dispatch (or one carrying prompt pieces and the decode rows) raises: the requests
    it touched end with the error; where the failed call consumed the cache the device is reset.
    The next requests are served exactly."""
    llm = _engine_llm(tiny_model, max_slots=4, max_seq_len=128, max_num_batched_tokens=64, decode_steps=steps)
    device = llm.engine.device
    device.fail(kind, nth, consumed=consumed)
    failed = _generate(llm, _prompts(2, seed=8), [10, 10])
    assert [c.finish_reason for c in failed] == ["error", "error"]
    assert "simulated device fault" in failed[0].error
    assert device.resets == int(consumed)
    _assert_exact(_generate(llm, _prompts(3, seed=9), [7, 9, 11]), [7, 9, 11])
    assert llm.engine.stats()["slots_in_use"] == 0
