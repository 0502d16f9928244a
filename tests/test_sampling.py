"""Per-row sampling functions: each knob checked against values worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.sampling import (
    RequestError,
    SamplingArrays,
    SamplingParams,
    apply_penalties,
    argmax,
    pick,
    token_logprobs,
)
from jinfer.sampling import sample as _sample

sample = jax.jit(_sample)

LOGITS = jnp.asarray([[2.0, 1.0, 0.5, -1.0, 3.0]])  # best: 4, then 0, 1, 2, 3


def _arrays(n=1, seed=0, **knobs):
    return SamplingArrays.from_params([SamplingParams(**knobs).resolve()] * n, [seed] * n)


def _draws(knobs, n=400, logits=LOGITS):
    """Tokens drawn at n different positions (independent keys) with the same logits."""
    s = _arrays(n, **knobs)
    return np.asarray(sample(jnp.repeat(logits, n, axis=0), s, jnp.arange(n)))


def test_greedy_is_argmax():
    assert set(_draws({"temperature": 0.0}, n=20)) == {4}


def test_greedy_argmax_picks_what_jnp_argmax_picks_on_ties_nan_and_infinities():
    rows = np.random.default_rng(1).standard_normal((7, 50)).astype(np.float32)
    rows[1, [9, 3]] = 10.0  # a tie: the first index
    rows[2, [7, 5]] = [100.0, np.nan]  # a NaN counts as the maximum
    rows[3, [20, 8]] = np.inf
    rows[4] = -np.inf  # nothing but -inf: index 0
    rows[5, [49, 0]] = np.nan
    rows[6, 30] = -np.inf
    got = np.asarray(jax.jit(argmax)(jnp.asarray(rows)))
    assert got.dtype == np.int32
    assert got.tolist() == [int(np.argmax(rows[0])), 3, 5, 8, 0, 0, int(np.argmax(rows[6]))]
    assert got.tolist() == np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)).tolist()


def test_temperature_sampling_follows_softmax():
    draws = _draws({"temperature": 1.0}, n=4000)
    expected = np.asarray(jnp.exp(LOGITS[0]) / jnp.exp(LOGITS[0]).sum())
    observed = np.bincount(draws, minlength=5) / len(draws)
    assert np.abs(observed - expected).max() < 0.03


def test_top_k_top_p_min_p_restrict_the_candidates():
    assert set(_draws({"temperature": 1.0, "top_k": 2})) == {4, 0}
    # probabilities ~ [.23, .08, .05, .01, .63]: top_p 0.8 keeps 4 and 0 (0.63 < 0.8, 0.86 >= 0.8)
    assert set(_draws({"temperature": 1.0, "top_p": 0.8})) == {4, 0}
    assert set(_draws({"temperature": 1.0, "top_p": 0.5})) == {4}
    # min_p 0.2 keeps tokens with p >= 0.2 * 0.63 = 0.126: tokens 4 and 0
    assert set(_draws({"temperature": 1.0, "min_p": 0.2})) == {4, 0}
    assert set(_draws({"temperature": 100.0, "top_k": 1})) == {4}


def test_same_seed_and_position_give_the_same_token_whatever_the_row():
    logits = jnp.repeat(LOGITS, 3, axis=0)
    s = SamplingArrays.from_params([SamplingParams(temperature=1.0).resolve()] * 3, [7, 8, 7])
    positions = jnp.asarray([5, 5, 5])
    first = np.asarray(sample(logits, s, positions))
    assert first[0] == first[2]
    many = [int(sample(LOGITS, _arrays(seed=7, temperature=1.0), jnp.asarray([5]))[0]) for _ in range(3)]
    assert many == [first[0]] * 3
    seeds = {int(sample(LOGITS, _arrays(seed=k, temperature=1.0), jnp.asarray([5]))[0]) for k in range(40)}
    assert len(seeds) > 1  # different seeds do draw differently


def test_penalties_by_hand():
    logits = jnp.asarray([[2.0, -2.0, 1.0, 0.0]])
    prompt_mask = jnp.asarray([[True, False, False, False]])
    counts = jnp.asarray([[0, 1, 3, 0]], jnp.int32)
    s = _arrays(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = np.asarray(apply_penalties(logits, prompt_mask, counts, s))
    # token 0: prompt only -> 2/2 = 1.  token 1: -2*2 - 0.25 - 0.5.
    # token 2: 1/2 - 0.75 - 0.5.  token 3: untouched.
    np.testing.assert_allclose(out, [[1.0, -4.75, -0.75, 0.0]])
    neutral = _arrays()
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, prompt_mask, counts, neutral)), logits)
    # A batch skips the penalties only when every row is neutral; a neutral row beside a penalised
    # one keeps its logits bit for bit.
    rows = SamplingArrays.from_params(
        [SamplingParams(repetition_penalty=2.0).resolve(), SamplingParams().resolve()], [0, 0]
    )
    both = np.asarray(
        apply_penalties(
            jnp.tile(logits, (2, 1)), jnp.tile(prompt_mask, (2, 1)), jnp.tile(counts, (2, 1)), rows
        )
    )
    np.testing.assert_array_equal(both[1], logits[0])
    assert both[0, 0] == 1.0


def test_token_logprobs():
    chosen, values, ids = token_logprobs(LOGITS, jnp.asarray([1]), top_n=2)
    logp = np.asarray(LOGITS[0] - jnp.log(jnp.exp(LOGITS[0]).sum()))
    np.testing.assert_allclose(float(chosen[0]), logp[1], rtol=1e-6)
    assert ids.tolist() == [[4, 0]]
    np.testing.assert_allclose(np.asarray(values[0]), logp[[4, 0]], rtol=1e-6)


# LOGITS widened to more tokens than the alternatives a step reports, the new ones never likely.
WIDE_LOGITS = jnp.pad(LOGITS, ((0, 0), (0, 27)), constant_values=-1e9)


def _pick_logprobs(logits, s, positions):
    """pick's tokens and their log-probs with the top alternatives (jitted as a step runs it)."""
    token, out = jax.jit(pick)(logits, logits, s, positions, jnp.bool_(True))
    return np.asarray(token), np.asarray(out.logprobs), np.asarray(out.top_ids), np.asarray(out.top_logprobs)


def test_processed_logprobs_are_of_the_distribution_tokens_are_drawn_from():
    """logprobs_mode "processed": a row's log-probs are of its tempered, truncated distribution;
    4,000 draws at independent positions land on its tokens as often as those log-probs say (a
    chi-square test, deterministic through the seeds), and nowhere else. A raw row beside it keeps
    the bits it has in a batch where no row asks for processed log-probs."""
    knobs = {"temperature": 0.7, "top_k": 4, "top_p": 0.95}
    n = 4000
    params = [SamplingParams(logprobs_mode="processed", **knobs).resolve()] * n
    params[0] = SamplingParams(**knobs).resolve()  # raw
    s = SamplingArrays.from_params(params, [3] * n)
    logits = jnp.repeat(WIDE_LOGITS, n, axis=0)
    tokens, chosen, top_ids, top_values = _pick_logprobs(logits, s, jnp.arange(n))
    scaled = LOGITS[0] / 0.7
    probs = np.asarray(jnp.exp(scaled - jax.scipy.special.logsumexp(scaled)))
    kept = [4, 0, 1]  # 4 and 0 hold 0.88 < 0.95 of the mass; 1 (0.07) takes it past: top_p stops there
    expected = np.zeros(WIDE_LOGITS.shape[1])
    expected[kept] = probs[kept] / probs[kept].sum()
    reported = dict(zip(top_ids[1].tolist(), top_values[1].tolist(), strict=True))
    np.testing.assert_allclose([np.exp(reported[t]) for t in kept], expected[kept], rtol=1e-5)
    assert all(reported[t] == -np.inf for t in set(range(5)) - set(kept))
    np.testing.assert_allclose(np.exp(chosen[1:]), expected[tokens[1:]], rtol=1e-5)
    observed = np.bincount(tokens[1:], minlength=len(expected))
    assert set(np.flatnonzero(observed)) == set(kept)
    statistic = ((observed[kept] - (n - 1) * expected[kept]) ** 2 / ((n - 1) * expected[kept])).sum()
    assert statistic < 13.8  # chi-square, 2 degrees of freedom: p = 0.001
    raw = SamplingArrays.from_params([params[0]], [3])
    raw_token, raw_chosen, raw_ids, raw_values = _pick_logprobs(WIDE_LOGITS, raw, jnp.arange(1))
    assert (tokens[0], chosen[0]) == (raw_token[0], raw_chosen[0])
    np.testing.assert_array_equal(top_ids[0], raw_ids[0])
    np.testing.assert_array_equal(top_values[0], raw_values[0])


def test_processed_logprobs_of_a_greedy_row_keep_the_penalties_and_bans_at_temperature_one():
    """A greedy row draws nothing: its processed log-probs are of the processed logits (what
    `process` made of them) with its truncation, at temperature 1; its token is their argmax."""
    processed = WIDE_LOGITS.at[0, 4].set(-jnp.inf)  # e.g. a ban on the likeliest token
    s = _arrays(temperature=0.0, top_k=3, logprobs_mode="processed")
    token, out = jax.jit(pick)(WIDE_LOGITS, processed, s, jnp.arange(1), jnp.bool_(True))
    assert int(token[0]) == 0
    kept = np.asarray(LOGITS[0, jnp.asarray([0, 1, 2])])
    logp = kept - np.log(np.exp(kept).sum())
    np.testing.assert_allclose(float(out.logprobs[0]), logp[0], rtol=1e-6)
    assert np.asarray(out.top_ids[0, :3]).tolist() == [0, 1, 2]


def test_logprobs_mode_is_raw_or_processed():
    with pytest.raises(RequestError, match="logprobs_mode must be raw or processed"):
        SamplingParams(logprobs_mode="processed_logits")
