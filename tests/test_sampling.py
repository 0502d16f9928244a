"""Per-row sampling functions: each knob checked against values worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.sampling import SamplingArrays, SamplingParams, apply_penalties, argmax, token_logprobs
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
