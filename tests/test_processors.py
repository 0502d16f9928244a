"""Logits processors registered by name (`jinfer.processors`): the two shipped ones against
transformers' processors of the same rules, refused at registration when they cannot run, and in
the engine: what they promise, in a crowd, with n-gram speculation, with nothing compiled after
warm-up."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
from test_server import KEY, running_server
from tiny import VOCAB
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    NoRepeatNGramLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

import jinfer
from jinfer.inputs import InputSpec, RowProcessor, processor_inputs
from jinfer.processors import ban_tokens, load, no_repeat_ngram, registered
from jinfer.sampling import RequestError, TokenHistory

SEQ = 48


def _history(sequences, stops=None, generated=None):
    """TokenHistory rows of these token lists in a buffer of SEQ (its tail stale: 7s)."""
    tokens = np.full((len(sequences), SEQ), 7, np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = seq
    lengths = jnp.array([len(s) for s in sequences], jnp.int32)
    stops = np.zeros((len(sequences), VOCAB), bool) if stops is None else stops
    generated = jnp.asarray(np.zeros(len(sequences)) if generated is None else generated, jnp.int32)
    return TokenHistory.of(jnp.asarray(tokens), lengths, generated, jnp.asarray(stops))


def _apply(processor, logits, history, args):
    """The processor over rows whose requests give these parameters (None: none)."""
    values = [processor_inputs([processor], {processor.name: a} if a is not None else None) for a in args]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *[v[processor.name] for v in values])
    return np.asarray(processor.apply(jnp.asarray(logits), history, stacked))


def test_no_repeat_ngram_bans_what_transformers_bans():
    rng = np.random.RandomState(0)
    sequences = [rng.randint(0, 6, length).tolist() for length in (1, 2, 5, 17, 31, SEQ)]
    sequences[-1] = ([1, 2, 3, 4, 5] * SEQ)[:SEQ]  # every n-gram comes back
    logits = rng.randn(len(sequences), VOCAB).astype(np.float32)
    processor = no_repeat_ngram()
    for n in (1, 2, 3, 4, 8):
        got = _apply(processor, logits, _history(sequences), [n] * len(sequences))
        for row, seq in enumerate(sequences):
            theirs = NoRepeatNGramLogitsProcessor(n)(torch.tensor([seq]), torch.tensor(logits[row : row + 1]))
            np.testing.assert_array_equal(np.isinf(got[row]), np.isinf(theirs.numpy()[0]), err_msg=f"n={n}")
        assert np.isinf(got[-1]).sum() == (5 if n == 1 else 1)  # every token seen; the motif's next
    neutral = _apply(processor, logits, _history(sequences), [0, None, 0, None, 0, None])
    np.testing.assert_array_equal(neutral, logits)


def test_ban_list_and_length_penalty_as_transformers():
    rng = np.random.RandomState(1)
    logits = rng.randn(4, VOCAB).astype(np.float32) * 3
    stops = np.zeros((4, VOCAB), bool)
    stops[:, [5, 9]] = True
    generated = [0, 3, 10, 10]
    history = _history([[1, 2, 3]] * 4, stops, generated)
    args = [
        {"tokens": [4, 11, 300]},
        {"length_penalty": [2, 1.5]},
        {"tokens": [9], "length_penalty": [4, 1.2]},
        None,
    ]
    got = _apply(ban_tokens(), logits, history, args)
    for row, (arg, made) in enumerate(zip(args, generated, strict=True)):
        theirs = torch.tensor(logits[row : row + 1])
        prompt = torch.zeros((1, 3 + made), dtype=torch.long)  # transformers counts from the prompt's end
        if arg and "length_penalty" in arg:
            theirs = ExponentialDecayLengthPenalty(tuple(arg["length_penalty"]), [5, 9], 3)(prompt, theirs)
        if arg and "tokens" in arg:
            theirs = SuppressTokensLogitsProcessor(arg["tokens"])(prompt, theirs)
        np.testing.assert_allclose(got[row], theirs.numpy()[0], rtol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])  # neutral: untouched
    assert got[1, 5] > logits[1, 5] and got[0, 5] == logits[0, 5]


@pytest.mark.parametrize(
    "args,message",
    [
        ({"nope": 1}, "no registered logits processor"),
        ({"no_repeat_ngram": 99}, "n must be in 0..8"),
        ({"no_repeat_ngram": "3"}, "must be an integer"),
        ({"ban_tokens": {"tokens": [-1]}}, "non-negative"),
        ({"ban_tokens": {"tokens": list(range(65))}}, "at most 64"),
        ({"ban_tokens": {"length_penalty": [1, -2]}}, "factor > 0"),
        ({"ban_tokens": [1, 2]}, '"tokens"'),
    ],
)
def test_bad_parameters_are_a_request_error(args, message):
    with pytest.raises(RequestError, match=message):
        processor_inputs([no_repeat_ngram(), ban_tokens()], args)


def _raising(logits, history, values):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    "apply,message",
    [
        (_raising, "fails when traced: RuntimeError: boom"),
        (lambda logits, history, values: logits[:, :-1], "returns"),
        (lambda logits, history, values: logits.astype(jnp.int32), "returns"),
        (lambda logits, history, values: (logits, logits), "returns tuple"),
        (lambda logits, history, values: logits + history.missing, "fails when traced"),
    ],
)
def test_a_processor_that_cannot_run_is_refused_when_registered(apply, message):
    broken = RowProcessor("broken", InputSpec(("rows",), np.int32, 0), int, apply)
    with pytest.raises(ValueError, match=message):
        registered({"broken": broken}, vocab=VOCAB, seq=SEQ)
    with pytest.raises(ValueError, match="distinct names"):
        registered([no_repeat_ngram(), no_repeat_ngram()], vocab=VOCAB, seq=SEQ)


def test_a_server_flag_names_a_processor():
    assert load("jinfer.processors:no_repeat_ngram").name == "no_repeat_ngram"
    assert load("nr=jinfer.processors:no_repeat_ngram").name == "nr"
    wrong = ("jinfer.processors", "jinfer.nothing:x", "jinfer.processors:nothing", "jinfer.processors:Any")
    for flag in wrong:
        with pytest.raises(ValueError):
            load(flag)


# --- in the engine ------------------------------------------------------------------------------

OPTIONS = {"max_slots": 4, "max_seq_len": 128, "max_num_batched_tokens": 64, "decode_steps": 4}
PROCESSORS = {"no_repeat_ngram": no_repeat_ngram(), "ban": ban_tokens()}
GREEDY = jinfer.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _prompt(seed, length):
    return np.random.RandomState(seed).randint(0, VOCAB, length).tolist()


def _looping(seed, length):
    motif = _prompt(seed, 5)
    return (motif * (length // 5 + 1))[:length]


@pytest.fixture(scope="module")
def engines(tiny_model):
    path = tiny_model("llama_gqa_untied")[0]
    return {
        "plain": jinfer.LLM(path, **OPTIONS),
        "processors": jinfer.LLM(path, logits_processors=PROCESSORS, **OPTIONS),
        "speculative": jinfer.LLM(path, logits_processors=PROCESSORS, speculative="ngram", **OPTIONS),
    }


def _ngrams(tokens, n):
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _repeats(prompt, output, n) -> int:
    """How many output tokens complete an n-gram already in the sequence before them."""
    sequence = prompt + output
    ends = range(max(len(prompt), n - 1), len(sequence))
    return sum(tuple(sequence[t - n + 1 : t + 1]) in _ngrams(sequence[:t], n) for t in ends)


def _crowd(plain_outputs):
    """Six requests: the first two without processors, then no-repeat (n 3, and 8: repeats of up
    to 7 tokens, so n-gram drafts are accepted, and the ban at the 8th depends on the drafts before
    it), then a ban of the tokens the plain engine gave the row (and a length penalty on a seeded
    row)."""
    prompts = [_looping(s, 12 + 3 * s) for s in range(6)]
    seeded = dataclasses.replace(GREEDY, temperature=1.0, seed=5)
    args = [None, None, {"no_repeat_ngram": 3}, {"no_repeat_ngram": {"n": 8}}]
    args += [{"ban": {"tokens": sorted(set(plain_outputs[4]))[:64]}}]
    args += [{"ban": {"tokens": plain_outputs[5][:4], "length_penalty": [3, 1.3]}}]
    samplings = [dataclasses.replace(seeded if i == 5 else GREEDY, extra_args=a) for i, a in enumerate(args)]
    return prompts, samplings


def test_processors_do_what_they_promise_in_a_crowd_and_with_speculation(engines):
    prompts = [_looping(s, 12 + 3 * s) for s in range(6)]
    plain = [c.token_ids for c in engines["plain"].generate(prompts, [GREEDY] * 5 + [_seeded()])]
    prompts, samplings = _crowd(plain)
    got = [c.token_ids for c in engines["processors"].generate(prompts, samplings)]
    assert got[:2] == plain[:2]  # rows without processors: as the plain engine's
    for row, n in ((2, 3), (3, 8)):
        assert _repeats(prompts[row], got[row], n) == 0, f"row {row} repeated an {n}-gram"
        assert _repeats(prompts[row], plain[row], n) > 0  # as the plain engine does
    assert not set(got[4]) & set(plain[4]) and got[4] != plain[4]
    assert not set(got[5]) & set(plain[5][:4])
    speculative = engines["speculative"]
    assert [c.token_ids for c in speculative.generate(prompts, samplings)] == got
    before = speculative.engine.dispatch_counts.accepted_tokens
    assert [c.token_ids for c in speculative.generate(prompts[3:4], samplings[3:4])] == got[3:4]
    assert speculative.engine.dispatch_counts.accepted_tokens > before  # drafts taken under no-repeat


def _seeded():
    return dataclasses.replace(GREEDY, temperature=1.0, seed=5)


def test_alone_equals_in_the_crowd_and_nothing_compiles_after_warm_up(engines):
    llm = engines["speculative"]
    prompts = [_looping(s, 12 + 3 * s) for s in range(6)]
    plain = [c.token_ids for c in engines["plain"].generate(prompts, [GREEDY] * 5 + [_seeded()])]
    prompts, samplings = _crowd(plain)
    llm.engine.warmup()
    before = llm.engine.compile_count()
    crowd = [c.token_ids for c in llm.generate(prompts, samplings)]
    alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, samplings, strict=True)]
    assert alone == crowd
    assert llm.engine.compile_count() == before


def test_a_request_naming_no_registered_processor_is_refused_before_the_engine(engines):
    llm = engines["processors"]
    bad = dataclasses.replace(GREEDY, extra_args={"no_repeat_ngramm": 3})
    with pytest.raises(RequestError, match="registered: ban, no_repeat_ngram"):
        llm.generate([_prompt(1, 9)], [bad])
    assert llm.engine.stats()["slots_in_use"] == 0 and not llm.engine.scheduler.has_work
    with pytest.raises(RequestError, match="no registered logits processor"):
        engines["plain"].generate([_prompt(1, 9)], [dataclasses.replace(GREEDY, extra_args={"ban": {}})])


def test_a_verify_steps_later_positions_see_the_drafts_before_them():
    """Position j of a verify step is chosen after t_0 .. t_j, which drafts 0..j stand for (the
    state already holds t_0 at its position): the history each position's processors see."""
    from jinfer.sharding import make_mesh
    from jinfer.speculative import _drafted_history
    from jinfer.state import new_state, state_shardings

    state = new_state(2, VOCAB, 12, state_shardings(make_mesh()))
    state = state.replace(
        history=jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) + 100),
        positions=jnp.array([3, 6], jnp.int32),
        generated=jnp.array([1, 2], jnp.int32),
    )
    drafts = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    seen = _drafted_history(state, drafts)
    assert seen.tokens.shape == (2, 3, 12)
    for row, (position, made) in enumerate(((3, 1), (6, 2))):
        for j in range(3):
            past = list(range(100 + 12 * row, 100 + 12 * row + position))  # before t_0's position
            expected = past + np.asarray(drafts[row, : j + 1]).tolist()
            assert np.asarray(seen.tokens[row, j]).tolist() == expected + [-1] * (12 - len(expected))
            assert seen.length[row, j] == position + 1 + j and seen.generated[row, j] == made + j


# --- over HTTP ------------------------------------------------------------------------------------

SERVED = [
    "--max-slots", "4", "--max-seq-len", "128", "--decode-steps", "4", "--api-key", KEY,
    "--served-model-name", "m",
    "--logits-processor", "jinfer.processors:no_repeat_ngram",
    "--logits-processor", "ban=jinfer.processors:ban_tokens",
]  # fmt: skip


def test_the_server_registers_processors_by_flag_and_requests_select_them(engines, tiny_model):
    prompts = [_looping(s, 12 + 3 * s) for s in range(6)]
    plain = [c.token_ids for c in engines["plain"].generate(prompts, [GREEDY] * 5 + [_seeded()])]
    prompts, samplings = _crowd(plain)
    offline = engines["processors"].generate(prompts[2:5], samplings[2:5])
    with running_server(tiny_model("llama_gqa_untied")[0], *SERVED) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        for prompt, sampling, want in zip(prompts[2:5], samplings[2:5], offline, strict=True):
            spelling = "vllm_xargs" if "ban" in sampling.extra_args else "extra_args"
            got = client.completions.create(
                model="m", prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                extra_body={spelling: sampling.extra_args, "ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == want.text
        for extra, fragment in (
            ({"extra_args": {"ban": {"tokens": "x"}}}, "extra_args for the ban processor"),
            ({"extra_args": {"no_repeat": 2}}, "registered: ban, no_repeat_ngram"),
            ({"extra_args": [1]}, "extra_args must map names"),
            ({"extra_args": {}, "vllm_xargs": {}}, "not both"),
        ):
            with pytest.raises(openai.BadRequestError, match=fragment):
                client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=extra)
        assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_server_refuses_a_processor_it_cannot_find_at_start(tiny_model):
    flags = ("--logits-processor", "jinfer.nothing:x")
    with (
        pytest.raises(RuntimeError, match=r"--logits-processor 'jinfer\.nothing:x'"),
        running_server(tiny_model("llama_gqa_untied")[0], *flags),
    ):
        pass
