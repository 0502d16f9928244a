"""A per-row feature added from outside the engine: a logits processor registered with its input
per request (`jinfer.inputs.RowProcessor`), declared once here, applied in the one processing
chain of prompt, decode and verify steps, and replayed by a follower's device.

The test's processor adds `amount` to one token's logit, per request: the same arithmetic as a
logit bias of that token, so an engine with the bias is its reference, bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import VOCAB

import jinfer
from jinfer.cluster import decode, encode
from jinfer.inputs import InputSpec, RowProcessor
from jinfer.sampling import RequestError

# The whole feature: its input (a token and an amount per row; neutral: nothing added), how a
# request's extra_args["logit_offset"] becomes that input, and its use on the logits.
OFFSET = RowProcessor(
    name="logit_offset",
    spec=InputSpec(("rows", 2), np.float32, 0.0),
    of_args=lambda args: args,
    apply=lambda logits, history, values: logits.at[
        jnp.arange(logits.shape[0]), values[:, 0].astype(jnp.int32)
    ].add(values[:, 1]),
)
OPTIONS = {"max_slots": 2, "max_seq_len": 128, "max_num_batched_tokens": 64, "decode_steps": 2}
TOKEN, AMOUNT = 17, 2.5


def _prompt(seed, length):
    return np.random.RandomState(seed).randint(0, VOCAB, length).tolist()


def _repeating(seed, length):
    motif = _prompt(seed, 7)
    return (motif * (length // 7 + 1))[:length]


def _offset(sampling: jinfer.SamplingParams, token=TOKEN, amount=AMOUNT) -> jinfer.SamplingParams:
    return dataclasses.replace(sampling, extra_args={"logit_offset": (token, amount)})


def _biased(sampling: jinfer.SamplingParams, token=TOKEN, amount=AMOUNT) -> jinfer.SamplingParams:
    return dataclasses.replace(sampling, logit_bias={token: amount})


GREEDY = jinfer.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SEEDED = jinfer.SamplingParams(max_tokens=20, temperature=1.0, seed=77, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The tiny model plain, and with the processor (prompt pieces of two requests in one prefill
    dispatch, a row each; n-gram speculation: verify steps)."""
    path = tiny_model("llama_gqa_untied")[0]
    return {
        "plain": jinfer.LLM(path, **OPTIONS),
        "pieces": jinfer.LLM(path, logits_processors=[OFFSET], **OPTIONS | {"max_num_batched_tokens": 128}),
        "verify": jinfer.LLM(path, logits_processors=[OFFSET], speculative="ngram", **OPTIONS),
    }


def _crowd():
    """Five requests through two slots (three arrive while others decode), offset or not."""
    prompts = [_prompt(s, 9 + 4 * s) for s in range(3)] + [_repeating(5, 40), _repeating(6, 30)]
    samplings = [GREEDY, SEEDED, GREEDY, GREEDY, SEEDED]
    offset = [True, True, False, True, True]
    return prompts, samplings, offset


@pytest.mark.parametrize("kind", ["pieces", "verify"])
def test_a_registered_processor_acts_in_every_step_as_its_reference(engines, kind):
    prompts, samplings, offset = _crowd()
    llm = engines[kind]
    got = llm.generate(prompts, [_offset(s) if o else s for s, o in zip(samplings, offset, strict=True)])
    reference = engines["plain"].generate(
        prompts, [_biased(s) if o else s for s, o in zip(samplings, offset, strict=True)]
    )
    assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    plain = engines["plain"].generate(prompts, samplings)
    assert any(g.token_ids != p.token_ids for g, p, o in zip(got, plain, offset, strict=True) if o)
    counts = llm.engine.dispatch_counts
    if kind == "pieces":
        assert 0 < counts.prefill_dispatches < len(prompts)  # one carried two prompts' pieces
    else:
        assert counts.accepted_tokens > 0  # later positions of verify steps took offset tokens


def test_rows_that_leave_it_neutral_are_unchanged_and_a_large_offset_decides(engines):
    prompts, samplings, _ = _crowd()
    without = [c.token_ids for c in engines["pieces"].generate(prompts, samplings)]
    assert without == [c.token_ids for c in engines["plain"].generate(prompts, samplings)]
    (forced,) = engines["pieces"].generate(prompts[:1], [_offset(GREEDY, amount=1000.0)])
    assert forced.token_ids == [TOKEN] * GREEDY.max_tokens  # the first from the prompt step


def test_an_input_that_does_not_fit_its_declaration_is_refused_before_the_engine(engines):
    llm = engines["pieces"]
    bad = dataclasses.replace(GREEDY, extra_args={"logit_offset": (1, 2, 3)})
    with pytest.raises(RequestError, match="logit_offset processor: shape"):
        llm.generate([_prompt(1, 9)], [bad])
    assert llm.engine.stats()["slots_in_use"] == 0 and not llm.engine.scheduler.has_work
    (after,) = llm.generate([_prompt(1, 9)], [GREEDY])
    assert after.finish_reason == "length"


def test_a_follower_replaying_the_calls_holds_the_same_cache_and_state(tiny_model):
    """The leader's device calls, each sent through the cluster's message encoding and replayed
    by a second engine's device (what a follower process does), leave both devices the same."""
    path = tiny_model("llama_gqa_untied")[0]
    leader, follower = (jinfer.LLM(path, logits_processors=[OFFSET], **OPTIONS) for _ in range(2))
    leader.engine.device.publish = lambda verb, args: follower.engine.device.replay(
        *decode(encode(verb, args))
    )
    prompts, samplings, offset = _crowd()
    leader.generate(prompts, [_offset(s) if o else s for s, o in zip(samplings, offset, strict=True)])
    ours, theirs = leader.engine.device, follower.engine.device
    assert ours.cache.target.k[0].shape == theirs.cache.target.k[0].shape
    for a, b in zip(
        jax.tree.leaves((ours.state, ours.cache)), jax.tree.leaves((theirs.state, theirs.cache)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
