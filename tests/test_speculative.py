"""Speculative decoding (`jinfer.speculative`): the same tokens as decoding one at a time, greedy
and seeded, alone and in any crowd; sampled rows keep the model's distribution; stops, max_tokens
and cancellation stay exact when several tokens land in one step; no compiles after warm-up."""

import dataclasses
import math

import httpx
import jax
import numpy as np
import openai
import pytest
from test_engine import _cotenant as random_cotenant
from test_server import AUTH, KEY, TINY_OPTIONS, running_server
from tiny import VOCAB

import jinfer
from jinfer.config import EngineConfig
from jinfer.loading import CheckpointError
from jinfer.speculation import DraftRecord, Speculation
from jinfer.speculative import (
    DRAFT_SOURCES,
    best_length,
    ngram_drafts,
    prediction_drafts,
    program_lengths,
    verify_programs,
)

GREEDY = jinfer.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = jinfer.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
OPTIONS = {"max_slots": 4, "max_seq_len": 128, "max_num_batched_tokens": 128, "num_draft_tokens": 3}


def _prompt(seed, length, alphabet=VOCAB):
    return np.random.RandomState(seed).randint(3, alphabet, length).tolist()


def _repeating(seed, length):
    """A prompt that repeats itself (drafts find matches in it)."""
    motif = _prompt(seed, 7)
    return (motif * (length // 7 + 1))[:length]


def _cotenant(seed):
    """test_engine's random neighbour, seeded (its tokens are compared too), every other one on a
    prompt that repeats itself."""
    prompt, sampling = random_cotenant(seed)
    if seed % 2:
        prompt = _repeating(seed + 1000, len(prompt))
    return prompt, dataclasses.replace(sampling, seed=seed)


@pytest.fixture(scope="module")
def pair(tiny_model):
    """The same tiny model without and with n-gram speculation."""
    path = tiny_model("llama_gqa_untied")[0]
    return jinfer.LLM(path, **OPTIONS), jinfer.LLM(path, speculative="ngram", **OPTIONS)


# Draft models of the tiny target's vocabulary: the target itself (its greedy drafts are what the
# target picks: every one accepted), and another family (other weights, a sliding window: drafts
# mostly rejected).
DRAFTS = {"draft-self": "llama_gqa_untied", "draft-other": "mistral_sliding"}


@pytest.fixture(scope="module")
def speculating(tiny_model, pair):
    """Source -> the tiny model speculating with it."""
    path = tiny_model("llama_gqa_untied")[0]
    drafted = {
        name: jinfer.LLM(path, draft_model=tiny_model(family)[0], **OPTIONS)
        for name, family in DRAFTS.items()
    }
    return {"ngram": pair[1], **drafted}


def test_drafts_follow_the_latest_longest_earlier_match():
    history = np.zeros((4, 16), np.int32)
    history[0, :9] = [5, 6, 7, 8, 1, 5, 6, 7, 9]  # tail 6 7 9: no 3- or 2-gram match; 1-gram 9: none
    history[1, :9] = [5, 6, 7, 8, 2, 6, 7, 5, 6]  # tail 7 5 6 -> none; 5 6 at 0 -> 7 8 2 6
    history[2, :8] = [1, 2, 3, 4, 1, 2, 3, 1]  # 1-gram 1: latest at 4 -> 2 3 1 (then unknown)
    history[3, :6] = [9, 8, 9, 8, 9, 8]  # 9 8 9 8 at 0 (the longest earlier match) -> 9 8, then unknown
    positions = np.array([8, 8, 7, 5])  # the last token's position
    drafts, real, matched = (
        np.asarray(a) for a in jax.jit(ngram_drafts, static_argnums=2)(history, positions, 4)
    )
    assert matched.tolist() == [0, 2, 1, 4]
    assert not real[0].any()
    assert drafts[1].tolist() == [7, 8, 2, 6] and real[1].all()
    assert drafts[2, :3].tolist() == [2, 3, 1] and real[2].tolist() == [True, True, True, False]
    assert drafts[3, :2].tolist() == [9, 8] and real[3].tolist() == [True, True, False, False]


def test_prediction_drafts_follow_the_match_nearest_the_outputs_length():
    prediction = np.full((3, 16), -1, np.int32)
    prediction[:, :8] = [4, 5, 6, 4, 5, 7, 8, 9]  # "4 5" twice: after 6 and after 7
    history = np.zeros((3, 16), np.int32)
    history[0, :5] = [1, 2, 3, 4, 5]  # 2 outputs so far (prompt 1 2 3): 4 5 -> continue at 2
    history[1, :8] = [1, 2, 3, 9, 9, 9, 4, 5]  # 5 outputs: the second "4 5" -> 7 8 9, then its end
    history[2, :4] = [1, 2, 3, 9]  # the prediction's last token: nothing known after it
    positions, generated = np.array([4, 7, 3]), np.array([2, 5, 1])
    drafts, real, matched = (
        np.asarray(a)
        for a in jax.jit(prediction_drafts, static_argnums=4)(prediction, history, positions, generated, 4)
    )
    assert matched.tolist() == [2, 2, 0]
    assert drafts[0].tolist() == [6, 4, 5, 7] and real[0].all()
    assert drafts[1, :3].tolist() == [7, 8, 9] and real[1].tolist() == [True, True, True, False]
    assert not real[2].any()


def test_each_step_takes_the_draft_length_with_the_most_tokens_per_cost():
    """The device's choice per step (`best_length`): a row with long real drafts of a kind that is
    usually accepted verifies many; a batch whose drafts are short, seldom accepted or absent
    decodes plainly (length 0); a row's real drafts bound what a longer length can gain."""
    lengths, costs = (0, 1, 2, 4, 8), np.array([1.0, 1.1, 1.2, 1.35, 1.6])
    alphas = [0.05, 0.6, 0.9]  # a row's chances for drafts after 1-, 2- and 3-token matches

    def pick(kinds, real, counted=None):
        rows = len(kinds)
        counted = np.ones(rows, bool) if counted is None else np.array(counted)
        args = (np.array([alphas] * rows), np.array(kinds), np.array(real), counted)
        return lengths[int(best_length(lengths, costs, *args))]

    assert pick([2], [[True] * 8]) == 8
    assert pick([1], [[True] * 8]) == 4  # 2.31 over 1.35 beats 1.96 over 1.2 (2) and 2.48 over 1.6 (8)
    assert pick([0], [[True] * 8]) == 0  # 1.05 over 1.1 is less than 1
    assert pick([2], [[True] * 3 + [False] * 5]) == 4  # the 3 real drafts' gain, at 4's cost
    assert pick([2], [[False] * 8]) == 0
    assert pick([2], [[True] * 8], counted=[False]) == 8  # an idle row's plain token counts for nothing
    assert pick([2, 0], [[True] * 8] * 2) == 8  # one copying row pays for a step both take
    assert pick([0] * 4, [[True] * 8] * 4) == 0


def test_the_host_verifies_where_some_length_could_pay():
    """Host-side policy on requests' records (values it reads and returns): n-gram rows get the
    program of every length (the device picks) while their best kind could pay; a draft model's
    rows get the length that pays best; plain decoding, with a request's evidence fading, where
    none could; nothing for rows that may not draft."""
    from types import SimpleNamespace as Layout

    def policy(source, variants, cost):
        policy = Speculation(Layout(speculative=source, verify_variants=variants))
        policy.cost = cost
        return policy

    def evidence(own, pooled=(0.0, 0.0)):
        """A request's evidence: per kind (accepted, rejected), then (accepted, expected) of all kinds."""
        return np.array([*own, pooled], np.float32)

    fresh = DraftRecord(drafting=True)
    variants = ((1, 1), (1, 2), (1, 4), (16, 1))
    cost = {(1, 1): 1.3, (1, 2): 1.6, (1, 4): 2.1, (16, 1): 2.0}  # 16x1: 1 + 0.92 of a token, at best
    ngram = policy("ngram", variants, cost)
    (k, plan), records = ngram.choose(1, [fresh], steps=4)
    assert k == 4 and plan.drafting.tolist() == [True] and plan.force == -1 and records == [fresh]
    assert plan.costs.tolist() == pytest.approx([1.0, 1.3, 1.6, 2.1])  # lengths 0, 1, 2, 4
    assert plan.chances[0].tolist() == pytest.approx(DRAFT_SOURCES["ngram"].priors)
    failing = evidence([[0.0, 5.0]] * len(DRAFT_SOURCES["ngram"].priors), pooled=(0.0, 5.0))
    drifting, plain = DraftRecord(drafting=True, evidence=failing), 0
    while (chosen := ngram.choose(1, [drifting], steps=4))[0] is None:
        (drifting,) = chosen[1]
        plain += 1
        assert plain < 50
    assert plain >= 3 and (ngram.chances(drifting.evidence) > ngram.chances(failing)).all()
    crowd = [fresh] * 8 + [None] * 8
    assert all(ngram.choose(16, crowd, steps=4) == (None, crowd) for _ in range(100))
    assert ngram.choose(1, [DraftRecord()], steps=4)[0] is None
    # A bucket whose verify steps all decoded plainly (no draft checked) decodes plainly for a
    # while, then tries again.
    tokens = np.full((4, 5, 1), -1)
    tokens[:, 0] = 7  # each step emitted its first token only
    idle = fresh
    while ngram.choose(1, [idle], steps=4)[0] is not None:
        (idle,), tally = ngram.record(
            [idle], tokens.reshape(20, 1), 4, np.zeros((4, 1), int), np.zeros((4, 1), int)
        )
        assert tally.drafted == tally.accepted == 0
    plain = 1
    while ngram.choose(1, [idle], steps=4)[0] is None:
        plain += 1
    assert 1 < plain < 20 and idle.verify_steps == 0 and idle.evidence is None
    # A request's drafts rejected after 6-token matches lower its chances after every match
    # length; drafts accepted raise them.
    engine = ngram.chances(None)
    (rejecting,), tally = ngram.record([fresh], tokens[:1].reshape(5, 1), 1, np.array([[4]]), np.array([[5]]))
    assert (ngram.chances(rejecting.evidence) < engine).all() and (tally.drafted, tally.accepted) == (4, 0)
    (copying,), tally = ngram.record([fresh], np.full((5, 1), 7), 1, np.array([[4]]), np.array([[5]]))
    assert (ngram.chances(copying.evidence) > engine).all() and (tally.drafted, tally.accepted) == (4, 4)
    assert fresh.evidence is None and fresh.drafted == 0  # the records given are left as they were
    # Fresh requests start from the acceptance the engine has seen: drafts after 6-token matches
    # rejected again and again lower a newcomer's chance for them.
    for _ in range(10):
        (idle,), _ = ngram.record([idle], tokens.reshape(20, 1), 4, np.full((4, 1), 4), np.full((4, 1), 5))
    assert idle.verify_steps == 40 and idle.accepted == 0 and idle.drafted == 160
    newcomer = ngram.choose(1, [fresh], steps=4)[0][1].chances[0]
    assert newcomer[5] < 0.5 < DRAFT_SOURCES["ngram"].priors[5]
    assert newcomer[:5] == pytest.approx(plan.chances[0][:5])

    model = policy("draft", variants, cost)
    copying = DraftRecord(drafting=True, evidence=evidence([[40.0, 1.0]]))
    (k, plan), _ = model.choose(1, [copying], steps=4)
    assert k == 4 and plan.costs.tolist() == pytest.approx([2.1])
    agreeing = DraftRecord(drafting=True, evidence=evidence([[3.0, 3.0]]))  # α (3 + 2 x 0.9) / (6 + 2) = 0.6
    assert model.choose(1, [agreeing], steps=4)[0][0] == 1  # (1 + 0.6) / 1.3 beats 2 and 4 drafts
    # Where its passes are dear (the embedded Q4_1 file drafting for its float32 self), a fresh
    # request tries the draft model anyway; one whose drafts agree at 0.6 does not.
    dear = policy(
        "draft", ((1, 1), (1, 2), (1, 4), (1, 8)), {(1, 1): 1.9, (1, 2): 2.4, (1, 4): 3.7, (1, 8): 4.9}
    )
    assert dear.choose(1, [fresh], steps=4)[0][0] == 8
    assert dear.choose(1, [agreeing], steps=4)[0] is None
    # A draft model is fed by plain steps only where a verify step could pay at the engine's
    # chances; where none could, its requests' records stop drafting.
    bucket = lambda busy: next(b for b in (1, 4, 16, 32) if b >= busy)
    assert model.feeds_draft([fresh, *[None] * 31], bucket) == (True, [fresh, *[None] * 31])
    feeds, records = model.feeds_draft([fresh] * 8 + [None] * 24, bucket)
    assert not feeds and [r.drafting for r in records[:8]] == [False] * 8 and records[8:] == [None] * 24
    assert not model.feeds_draft([*[None] * 31, fresh], bucket)[0]  # none pays at 32


def test_the_always_policy_verifies_every_draft_whatever_it_costs():
    """`speculative_policy="always"`: a crowd, a request whose drafts keep failing and a bucket
    whose steps checked none all still get the verify program of the longest length, each
    length costed as a decode step (so the device takes the longest drafts a row has)."""
    from types import SimpleNamespace as Layout

    variants = ((1, 1), (1, 2), (1, 4), (16, 1))
    always = Speculation(Layout(speculative="ngram", verify_variants=variants), "always")
    failing = np.array([[0.0, 50.0]] * (len(DRAFT_SOURCES["ngram"].priors) + 1), np.float32)
    rows = [DraftRecord(drafting=True, evidence=failing)]
    (k, plan), _ = always.choose(1, rows, steps=4)
    assert k == 4 and plan.costs.tolist() == [1.0] * 4
    always.useful[1] = 0.0
    assert always.choose(1, rows, steps=4)[0][0] == 4
    crowd = [DraftRecord(drafting=True)] * 8 + [None] * 8
    assert always.choose(16, crowd, steps=4)[0][0] == 1
    measured = Speculation(Layout(speculative="ngram", verify_variants=variants))
    measured.cost[16, 1] = 2.0  # 1 + 0.92 of a token, at best
    assert measured.choose(16, crowd, steps=4)[0] is None
    with pytest.raises(ValueError, match="speculative_policy must be one of measured, always"):
        EngineConfig(speculative="ngram", speculative_policy="sometimes")


def test_layout_compiles_draft_lengths_within_the_kernels_columns(tiny_model):
    from jinfer.layout import SPECULATIVE_COLUMNS

    path = tiny_model("llama_gqa_untied")[0]
    llm = jinfer.LLM(path, max_slots=8, max_seq_len=64, speculative="ngram", num_draft_tokens=5)
    variants = llm.engine.layout.verify_variants
    assert variants == ((1, 1), (1, 2), (1, 4), (1, 5), (4, 1), (4, 2), (4, 4), (4, 5), (8, 1), (8, 2))
    assert all(rows * (k + 1) <= SPECULATIVE_COLUMNS for rows, k in variants)
    # N-gram drafts: one program per slot bucket, of every length up to its longest and 0; a draft
    # model: one per variant, of its own length.
    assert verify_programs("ngram", variants) == ((1, 5), (4, 5), (8, 2))
    assert program_lengths("ngram", variants, 5) == (0, 1, 2, 4, 5)
    assert program_lengths("ngram", variants, 2) == (0, 1, 2)
    assert verify_programs("draft", variants) == variants and program_lengths("draft", variants, 4) == (4,)


@pytest.mark.parametrize("source", ["ngram", *DRAFTS])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_with_speculation_in_every_slot(pair, speculating, sampling, source, monkeypatch):
    off, on = pair[0], speculating[source]
    # The engine's acceptance so far as a fresh engine's: an earlier case's rejected drafts must
    # not keep this one from drafting.
    monkeypatch.setattr(on.engine.speculation, "seen", Speculation(on.engine.layout).seen)
    target = _repeating(7, 30)
    (alone,) = off.generate([target], sampling)
    counts = on.engine.dispatch_counts
    before = counts.accepted_tokens, counts.draft_tokens
    (spec_alone,) = on.generate([target], sampling)
    assert spec_alone.token_ids == alone.token_ids
    greedy_rows = [spec_alone.metrics]
    for slot in range(4):
        neighbours = [_cotenant(10 * slot + i) for i in range(6)]
        prompts, samplings = [p for p, _ in neighbours], [s for _, s in neighbours]
        prompts.insert(slot, target)
        samplings.insert(slot, sampling)
        plain, speculative = off.generate(prompts, samplings), on.generate(prompts, samplings)
        assert speculative[slot].token_ids == alone.token_ids, slot
        greedy_rows.append(speculative[slot].metrics)
        assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
        assert [r.logprobs for r in speculative] == [r.logprobs for r in plain]
    accepted, drafted = counts.accepted_tokens - before[0], counts.draft_tokens - before[1]
    assert counts.verify_dispatches > 0 and drafted > 0
    if source != "draft-other":  # a model of other random weights guesses (next to) nothing
        assert accepted > 0  # several tokens a step
    if source == "draft-self" and sampling is GREEDY:
        # Its own greedy continuation: every draft is what the target then picks, as long as the
        # draft's cache holds each position the target's does.
        assert all(m["accepted_tokens"] == m["draft_tokens"] for m in greedy_rows), [
            (m["accepted_tokens"], m["draft_tokens"]) for m in greedy_rows
        ]
        assert sum(m["draft_tokens"] for m in greedy_rows) > 0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prediction_drafts_and_changes_no_token(pair, sampling, monkeypatch):
    """A request's predicted output (OpenAI's `prediction`): right, its tokens are drafted and
    accepted; partly wrong, some rejected; either way the output is the one without it, alone and beside
    others; the next request in its slot drafts nothing from it."""
    off, on = pair
    monkeypatch.setattr(on.engine.speculation, "seen", Speculation(on.engine.layout).seen)
    target = _prompt(3, 20)  # no repeats: its own tokens give (next to) no drafts
    (alone,) = off.generate([target], sampling)
    right = alone.token_ids
    wrong = [t if i % 5 else 3 + (t - 2) % (VOCAB - 3) for i, t in enumerate(right)]  # every fifth other
    (guessed,) = on.generate([target], sampling, prediction=[right])
    assert guessed.token_ids == alone.token_ids
    # How many depends on this machine's measured verify costs; that some are taken does not.
    assert 0 < guessed.metrics["accepted_prediction_tokens"] < len(alone.token_ids), guessed.metrics
    (missed,) = on.generate([target], sampling, prediction=[wrong])
    assert missed.token_ids == alone.token_ids
    assert missed.metrics["rejected_prediction_tokens"] > 0, missed.metrics
    (after,) = on.generate([target], sampling)  # slot 0 again, its prediction gone
    assert after.token_ids == alone.token_ids
    assert after.metrics["accepted_prediction_tokens"] == after.metrics["rejected_prediction_tokens"] == 0
    neighbours = [_cotenant(50 + i) for i in range(5)]
    prompts, samplings = [target] + [p for p, _ in neighbours], [sampling] + [s for _, s in neighbours]
    predictions = [right, None, wrong, None, right, None]
    crowd = on.generate(prompts, samplings, prediction=predictions)
    assert [r.token_ids for r in crowd] == [r.token_ids for r in off.generate(prompts, samplings)]
    assert crowd[0].metrics["accepted_prediction_tokens"] > 0


def _chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with dof degrees of freedom (Wilson-Hilferty)."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_keep_the_models_distribution(pair):
    """Three tokens (a bias leaves them all but alone) make drafts found and accepted often; the
    third output token, often emitted by a verify step's later position, follows the model's own
    probabilities given the two before (chi-square over every context), and each seed gives what
    it gives without speculation."""
    off, on = pair
    choices = (3, 4, 5)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    sampling = lambda seed: jinfer.SamplingParams(
        max_tokens=3, temperature=0.8, seed=seed, logit_bias=dict.fromkeys(choices, 100.0), ignore_eos=True
    )
    seeds = range(480)
    spec = on.generate([prompt] * len(seeds), [sampling(s) for s in seeds])
    plain = off.generate([prompt] * len(seeds), [sampling(s) for s in seeds])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.metrics["accepted_tokens"] for r in spec) > len(seeds) // 4
    by_context = {}
    for r in spec:
        by_context.setdefault(tuple(r.token_ids[:2]), []).append(r.token_ids[2])
    chi2, dof = 0.0, 0
    for context, thirds in by_context.items():
        logprobs = [on.score([prompt + list(context) + [c]])[0][-1] for c in choices]
        weights = np.exp((np.array(logprobs) - max(logprobs)) / 0.8)
        expected = len(thirds) * weights / weights.sum()
        observed = np.array([thirds.count(c) for c in choices])
        chi2 += float(((observed - expected) ** 2 / expected).sum())
        dof += len(choices) - 1
    assert _chi2_sf(chi2, dof) > 1e-3, (chi2, dof)


def test_each_step_of_a_dispatch_takes_its_own_draft_length(pair, monkeypatch):
    """An n-gram request's steps inside one verify dispatch each take their own length: plain where
    its match is short (or its drafts of that match length failed), the longest where its match is
    long; every token as without speculation."""
    off, on = pair
    policy = on.engine.speculation
    # Costs fixed (not this machine's): 1-token matches never pay, long ones pay for every draft;
    # the engine's acceptance so far as a fresh engine's.
    monkeypatch.setattr(policy, "cost", {key: 1.0 + 0.4 * key[1] for key in policy.cost})
    monkeypatch.setattr(policy, "seen", Speculation(on.engine.layout).seen)
    dispatches = []  # per verify dispatch, its steps' drafts checked (the request alone: row 0)
    record = policy.record

    def recording(records, tokens, steps, checked, kinds):
        emitted = (tokens.reshape(steps, -1, tokens.shape[-1]) >= 0).sum(axis=1)
        dispatches.append([int(checked[step, 0]) for step in range(steps) if emitted[step, 0]])
        return record(records, tokens, steps, checked, kinds)

    monkeypatch.setattr(policy, "record", recording)
    prompt, sampling = _repeating(21, 40), dataclasses.replace(GREEDY, max_tokens=60)
    assert on.generate([prompt], sampling)[0].token_ids == off.generate([prompt], sampling)[0].token_ids
    longest = max(policy.lengths[1])
    assert any(0 in steps and longest in steps for steps in dispatches), dispatches


@pytest.mark.parametrize("source", ["ngram", "draft-self"])
def test_stops_and_max_tokens_exact_when_several_tokens_land_in_a_step(pair, speculating, source):
    """A stop token, a stop string and max_tokens landing inside a verify step's accepted run end
    the output where decoding one token at a time ends it: never a token past them."""
    off, on = pair[0], speculating[source]
    prompt = _repeating(3, 30)
    (free,) = off.generate([prompt], GREEDY)
    ids = free.token_ids
    cases = [jinfer.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 5, 7, 11)] + [
        jinfer.SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ids[9]]),
        jinfer.SamplingParams(max_tokens=24, temperature=0, stop=[free.text[12:15]], ignore_eos=True),
        jinfer.SamplingParams(max_tokens=24, temperature=0, min_tokens=10, stop_token_ids=[ids[3]]),
    ]
    for sampling in cases:
        (want,), (got,) = off.generate([prompt], sampling), on.generate([prompt], sampling)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        if sampling.max_tokens < 24:
            assert len(got.token_ids) == sampling.max_tokens
    assert on.engine.dispatch_counts.accepted_tokens > 0


def test_a_crowd_where_verifying_cannot_pay_runs_without_the_draft(pair, speculating, monkeypatch):
    """Prompt chunks and plain dispatches in a batch no verify step could pay for skip the draft
    model's passes; its requests stop drafting (their draft cache misses those positions) and every
    token is still what decoding without speculation gives; requests alone later draft again."""
    off, on = pair[0], speculating["draft-self"]
    policy, device = on.engine.speculation, on.engine.device
    on.engine.warmup()
    compiled = on.engine.compile_count()
    monkeypatch.setattr(policy, "cost", {key: 100.0 if key[0] == 4 else 1.1 for key in policy.cost})
    fed = {"prefill": [], "decode": []}
    dispatch = device.dispatch

    def feeding(program, inputs, chunk=None):
        fed.get(program.kind, []).append(program.feeds_draft)
        return dispatch(program, inputs, chunk)

    monkeypatch.setattr(device, "dispatch", feeding)
    crowd = [_cotenant(seed) for seed in range(5)] + [(_repeating(9, 30), GREEDY)] * 2
    prompts, samplings = (list(column) for column in zip(*crowd, strict=True))
    assert [r.token_ids for r in on.generate(prompts, samplings)] == [
        r.token_ids for r in off.generate(prompts, samplings)
    ]
    assert False in fed["decode"] and False in fed["prefill"]
    (alone,) = on.generate([_repeating(9, 30)], GREEDY)
    assert alone.metrics["accepted_tokens"] == alone.metrics["draft_tokens"] > 0
    assert on.engine.compile_count() == compiled  # the warm-up compiled decoding without the draft


def test_a_drafting_request_finds_only_cached_pages_that_hold_the_drafts_k_v(pair, speculating):
    """A request that does not draft writes no K/V of the draft model: a drafting request with the
    same prompt computes its pages again (the draft would guess from whatever they held before),
    then finds them cached with the draft's K/V; a request that does not draft finds either."""
    on, kv = speculating["draft-self"], speculating["draft-self"].engine.kv
    prompt = _repeating(11, 100)  # a whole page of 64 positions to find again
    opted_out = dataclasses.replace(GREEDY, speculative=False)
    (plain,) = on.generate([prompt], opted_out)
    hits = kv.hits
    (drafting,) = on.generate([prompt], GREEDY)
    assert kv.hits == hits and drafting.token_ids == plain.token_ids
    (again,) = on.generate([prompt], GREEDY)
    assert kv.hits > hits and again.token_ids == plain.token_ids
    for completion in (drafting, again):  # its own greedy continuation: every draft accepted
        assert completion.metrics["accepted_tokens"] == completion.metrics["draft_tokens"] > 0
    hits = kv.hits
    on.generate([prompt], opted_out)
    assert kv.hits > hits


def test_cancel_frees_the_slot_and_sends_nothing_more(pair):
    _, on = pair
    engine = on.engine
    events = []
    prepared = engine.preparer.prepare(
        _repeating(5, 20), sampling=jinfer.SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    request = engine.submit(prepared, events.append)
    for _ in range(3):
        engine.step()
    assert request.slot is not None
    engine.cancel(request.request_id)
    sent = sum(len(e.token_ids) for e in events)
    engine.run_until_idle()
    assert events[-1].finish_reason == "abort" and sum(len(e.token_ids) for e in events) == sent
    assert all(slot is None for slot in engine.scheduler.slots)


def test_a_warmup_after_requests_leaves_the_prefix_cache_intact(pair):
    """The warm-up's own calls write (a prompt chunk into slot 0, and with speculation busy timed
    rows); the pages a finished request left cached must not be among what they write."""
    off, _ = pair
    prompt = _prompt(78, 100)  # a whole page of 64 positions to find again
    (first,) = off.generate([prompt], GREEDY)
    off.engine.warmup()
    hits = off.engine.kv.hits
    assert off.generate([prompt], GREEDY)[0].token_ids == first.token_ids
    assert off.engine.kv.hits > hits


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_no_compiles_after_warmup_and_penalised_or_opted_out_requests_decode_plainly(tiny_model, source):
    """With a small pool (prefix hits, preemptions) and, for a draft model, one of another
    architecture (grouped-query attention, untied embeddings) beside a Qwen2 target."""
    drafting = {
        "ngram": {"speculative": "ngram"},
        "draft": {"draft_model": tiny_model("llama_gqa_untied")[0]},
    }
    llm = jinfer.LLM(
        tiny_model("qwen2_bias_tied")[0], kv_cache_tokens=256, page_size=16, **drafting[source], **OPTIONS
    )
    cached_prompt = _prompt(77, 40)
    (first,) = llm.generate([cached_prompt], GREEDY)
    # The warm-up's timed rows are busy: they must not write into the pages the prefix cache holds.
    llm.engine.warmup()
    cost = llm.engine.speculation.cost
    assert set(cost) == set(llm.engine.layout.verify_variants)
    # Measured, yet never below a decode step nor below a shorter length of the same slot bucket.
    assert all(c >= 1.0 for c in cost.values())
    assert all(cost[rows, k] >= cost[r, n] for rows, k in cost for r, n in cost if r == rows and n < k)
    # Costs that let verifying pay, whatever this machine measured: every program gets used.
    llm.engine.speculation.cost = dict.fromkeys(llm.engine.speculation.cost, 1.1)
    hits = llm.engine.kv.hits
    assert llm.generate([cached_prompt], GREEDY)[0].token_ids == first.token_ids
    assert llm.engine.kv.hits > hits
    before = llm.engine.compile_count()
    prompts, samplings = zip(*[_cotenant(s) for s in range(14)], strict=True)
    samplings = list(samplings)
    samplings[0] = jinfer.SamplingParams(max_tokens=30, temperature=0, speculative=False, ignore_eos=True)
    samplings[1] = jinfer.SamplingParams(
        max_tokens=30, temperature=0, repetition_penalty=1.2, ignore_eos=True
    )
    results = llm.generate([_repeating(1, 30), _repeating(1, 30), *prompts[2:]], samplings)
    assert all(r.finish_reason == "length" for r in results)
    assert results[0].metrics["verify_steps"] == results[1].metrics["verify_steps"] == 0
    assert llm.engine.dispatch_counts.verify_dispatches > 0
    assert llm.engine.compile_count() == before


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_smollm2_same_text_with_speculation_beside_cotenants(smollm2_llm, smollm2_path, source):
    """The embedded model on an edit of its input (where drafts are accepted), alone and in each
    slot beside others, gives the text it gives without speculation; the draft model is the model
    itself (greedy rows accept every draft, sampled ones some)."""
    drafting = {"ngram": {"speculative": "ngram"}, "draft": {"draft_model": smollm2_path}}
    on = jinfer.LLM(max_slots=4, max_seq_len=512, **drafting[source])
    code = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
    edit = [
        {
            "role": "user",
            "content": "Rename the function area to rectangle_area and show the code:\n\n" + code,
        }
    ]
    others = [
        [{"role": "user", "content": "Name three rivers."}],
        [{"role": "user", "content": "What is 12 times 12?"}],
        [{"role": "user", "content": "Say hello in French."}],
    ]
    greedy = jinfer.SamplingParams(max_tokens=48, temperature=0)
    mixed = [jinfer.SamplingParams(max_tokens=30, temperature=0.7, seed=i) for i in range(3)]
    (want,) = smollm2_llm.chat([edit], greedy)
    assert on.chat([edit], greedy)[0].token_ids == want.token_ids
    for slot in (0, 3):
        chats = [*others[:slot], edit, *others[slot:]]
        samplings = [*mixed[:slot], greedy, *mixed[slot:]]
        got = on.chat(chats, samplings)
        assert got[slot].token_ids == want.token_ids, slot
        assert [r.token_ids for r in got] == [r.token_ids for r in smollm2_llm.chat(chats, samplings)]
    assert on.engine.dispatch_counts.accepted_tokens > 0


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_server_speculates_unless_a_request_opts_out(tiny_model, source):
    """`jinfer serve --speculative ngram` or `--draft-model PATH` (here the model itself): the
    same text with and without the request's opt-out, the drafts in the jinfer timings and the
    metrics; a non-boolean opt-out is a 400."""
    path = tiny_model("llama_gqa_untied")[0]
    drafting = {"ngram": ("--speculative", "ngram"), "draft": ("--draft-model", path)}
    with running_server(path, *TINY_OPTIONS, *drafting[source]) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        body = {"model": "tiny", "prompt": "one two one two one two", "max_tokens": 40, "temperature": 0}
        on = client.completions.create(**body, extra_body={"ignore_eos": True}).to_dict()
        off = client.completions.create(
            **body, extra_body={"ignore_eos": True, "speculative": False}
        ).to_dict()
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        timings_on, timings_off = on["jinfer"]["timings"][0], off["jinfer"]["timings"][0]
        assert timings_on["verify_steps"] > 0 and timings_on["accepted_tokens"] > 0, timings_on
        assert timings_off["verify_steps"] == timings_off["draft_tokens"] == 0
        if source == "ngram":  # OpenAI's Predicted Outputs, as its client sends them
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 30}
            plain = client.chat.completions.create(**chat, temperature=0)
            text = plain.choices[0].message.content
            guessed = client.chat.completions.create(
                **chat, temperature=0, prediction={"type": "content", "content": text}
            )
            assert guessed.choices[0].message.content == text
            details = guessed.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0, (text, details)
            assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        metrics = httpx.get(base + "/metrics", headers=AUTH).text
        assert "jinfer_verify_dispatches_total" in metrics and "jinfer_accepted_draft_tokens_total" in metrics
        bad = httpx.post(base + "/v1/completions", json={**body, "speculative": "yes"}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_a_draft_model_must_share_the_vocabulary_and_name_its_source(tiny_model, smollm2_path):
    path = tiny_model("llama_gqa_untied")[0]
    with pytest.raises(CheckpointError, match="does not share the vocabulary"):
        jinfer.LLM(path, draft_model=smollm2_path, **OPTIONS)  # 49152 tokens: enough ids, other tokens
    with pytest.raises(CheckpointError, match="fewer than"):
        jinfer.LLM(max_slots=1, max_seq_len=64, draft_model=path)  # 320 tokens for SmolLM2's 49152
    with pytest.raises(ValueError, match="speculative=draft needs one"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="a draft model drafts with speculative=draft"):
        EngineConfig(speculative="ngram", draft_model=path)
    assert EngineConfig(draft_model=path).speculative == "draft"
