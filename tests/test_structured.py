"""Constrained decoding (`jinfer.structured`): the allowed-token bitmask, the grammars it comes
from, and outputs held to JSON schemas, regular expressions and grammars through `LLM` and batch
jobs. The server's `response_format` is tested with the official client in test_structured_server.py."""

import json
import random
import re

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as lln
import numpy as np
import pytest
from tiny import train_sentencepiece, train_tokenizer

import jinfer
from jinfer.batch import run_jsonl
from jinfer.sampling import RequestError, SamplingParams, mask_disallowed
from jinfer.structured import ALL_ALLOWED, Grammars, closed_objects, mask_words

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
CODE = r"[0-9]{3}-[a-z]{2,4}"


def test_the_bitmask_keeps_exactly_the_tokens_whose_bit_is_set():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    allowed = rng.integers(-(2**31), 2**31, size=(3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    allowed[1] = ALL_ALLOWED  # a row without a constraint
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    expected = logits.copy()
    lln.apply_token_bitmask_inplace(expected, allowed)  # llguidance's own reading of its bitmask
    got = np.asarray(mask_disallowed(jnp.asarray(logits), jnp.asarray(allowed)))
    np.testing.assert_array_equal(got, expected)
    assert np.isneginf(got[0]).any() and not np.isneginf(got[1]).any()
    unconstrained = np.full_like(allowed, ALL_ALLOWED)
    np.testing.assert_array_equal(np.asarray(mask_disallowed(jnp.asarray(logits), unconstrained)), logits)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"json_schema": {"type": "object"}, "regex": "a+"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"grammar": 3}, "grammar"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1, 2]}, "json_schema"),
    ],
)
def test_constraint_fields_are_checked_when_sampling_params_are_made(fields, param):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**fields)
    assert caught.value.param == param


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A byte-level BPE tokenizer.json and a SentencePiece model with byte fallback."""
    made = {}
    for kind, train in (("bpe", train_tokenizer), ("sentencepiece", train_sentencepiece)):
        directory = str(tmp_path_factory.mktemp(kind))
        train(directory)
        made[kind] = jinfer.load_tokenizer(directory)
    return made


def _grammars(tokenizer):
    eos = tokenizer.eos_token_ids or (tokenizer.vocab_size - 1,)
    return Grammars(tokenizer, tokenizer.vocab_size, eos)


def random_walk(grammars, sampling, seed, limit=300):
    """Tokens drawn uniformly among each step's allowed ones until the constraint is complete (or,
    where it may end, an end-of-sequence token is drawn: one time in two), without that token."""
    constraint = grammars.compile(sampling).start()
    rng = random.Random(seed)
    row = np.empty(mask_words(grammars.vocab_size), np.int32)
    tokens = []
    while not constraint.complete and len(tokens) < limit:
        constraint.fill(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: grammars.vocab_size])
        ends = [t for t in allowed if t in grammars.eos_token_ids]
        token = int(
            ends[0] if ends and rng.random() < 0.5 else rng.choice([t for t in allowed if t not in ends])
        )
        assert constraint.accept(token)
        if token in ends:
            break
        tokens.append(token)
    assert constraint.complete
    return tokens


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_any_walk_through_the_allowed_tokens_spells_a_valid_output(tokenizers, kind):
    """Whatever the model would pick among the allowed tokens, the text is valid: so every
    token's bytes, as llguidance was told them, are the bytes the tokenizer decodes it to."""
    tokenizer = tokenizers[kind]
    grammars = _grammars(tokenizer)
    for seed in range(5):
        text = tokenizer.decode(random_walk(grammars, SamplingParams(json_schema=PERSON), seed))
        jsonschema.validate(json.loads(text), PERSON)
        text = tokenizer.decode(random_walk(grammars, SamplingParams(regex=CODE), seed))
        assert re.fullmatch(CODE, text), text


OPEN_PERSON = {  # PERSON saying nothing of other keys, with a nested object and a $defs entry
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}},
        "pet": {"$ref": "#/$defs/pet"},
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    },
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}},
}


def test_objects_that_declare_properties_hold_only_those_keys_unless_the_schema_allows_more(tokenizers):
    closed = closed_objects(OPEN_PERSON)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["home"]["additionalProperties"] is False
    assert closed["$defs"]["pet"]["additionalProperties"] is False
    assert closed["properties"]["tags"] == OPEN_PERSON["properties"]["tags"]  # says what it allows
    assert "additionalProperties" not in OPEN_PERSON  # the request's schema is not changed
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(both) == both  # each part sees only some of the keys: left as given
    grammars = _grammars(tokenizers["bpe"])
    for seed in range(8):
        text = tokenizers["bpe"].decode(random_walk(grammars, SamplingParams(json_schema=OPEN_PERSON), seed))
        jsonschema.validate(json.loads(text), closed)


def _nested_any_of(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {
            "anyOf": [{"type": "array", "items": schema}, {"type": "object", "additionalProperties": schema}]
        }
    return schema


def test_bad_constraints_are_request_errors_naming_the_field_and_good_ones_compile_once(tokenizers):
    grammars = _grammars(tokenizers["bpe"])
    bad = [
        (SamplingParams(json_schema={"type": "strin"}), "json_schema"),
        (SamplingParams(json_schema={"$ref": "#/$defs/missing"}), "json_schema"),
        (SamplingParams(regex="[0-9"), "regex"),
        (SamplingParams(grammar="start: missing_rule"), "grammar"),
        # Past the size taken (structured.MAX_CONSTRAINT_BYTES), and a schema whose anyOf branches
        # nest 40 deep (shared parts: 2**40 nodes written out), refused before llguidance sees it.
        (SamplingParams(json_schema={"enum": [f"v{i}" for i in range(200_000)]}), "json_schema"),
        (SamplingParams(json_schema=_nested_any_of(40)), "json_schema"),
    ]
    for sampling, param in bad:
        with pytest.raises(RequestError) as caught:
            grammars.compile(sampling)
        assert caught.value.param == param, caught.value
    first = grammars.compile(SamplingParams(json_schema=PERSON))
    assert grammars.compile(SamplingParams(json_schema=json.loads(json.dumps(PERSON)))) is first
    assert grammars.compile(SamplingParams()) is None


# --------------------------------------------------------------------------- SmolLM2, offline
ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


def test_llm_chat_outputs_validate_against_their_schema_greedy_and_sampled(smollm2_llm):
    schemas = [PERSON, {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}]
    for schema in schemas:
        greedy = SamplingParams(temperature=0, json_schema=schema, max_tokens=120)
        sampled = [
            SamplingParams(temperature=1.0, seed=s, json_schema=schema, max_tokens=120) for s in range(3)
        ]
        for completion in smollm2_llm.chat([ASK] * 4, [greedy, *sampled]):
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_lark_grammar_through_generate(smollm2_llm):
    out = smollm2_llm.generate(["My order code is"], SamplingParams(temperature=0, regex=CODE, max_tokens=20))
    assert re.fullmatch(CODE, out[0].text) and out[0].finish_reason == "stop"
    lark = 'start: answer "." \nanswer: "yes" | "no" | "maybe"'
    out = smollm2_llm.chat([ASK], SamplingParams(temperature=0, grammar=lark, max_tokens=10))
    assert out[0].text in ("yes.", "no.", "maybe.") and out[0].finish_reason == "stop"


def test_a_constrained_output_cut_by_max_tokens_ends_with_length(smollm2_llm):
    out = smollm2_llm.chat([ASK], SamplingParams(temperature=0, json_schema=PERSON, max_tokens=5))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out[0].text)


def test_greedy_outputs_are_the_same_alone_and_beside_constrained_neighbours(smollm2_llm):
    """Constrained requests take one token per dispatch, their decode rows deferred and sampled by
    a dispatch of their own; none of it may change what anyone gets, nor compile anything new."""
    prompts = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a fruit.")]
    plain = SamplingParams(temperature=0, max_tokens=24)
    constrained = SamplingParams(temperature=0, json_schema=PERSON, max_tokens=60)
    alone_plain = [smollm2_llm.chat([p], plain)[0].text for p in prompts]
    alone_constrained = smollm2_llm.chat([ASK], constrained)[0].text
    smollm2_llm.engine.warmup()  # every bucket compiled (most already are, by the tests before)
    compiled = smollm2_llm.engine.compile_count()
    crowd = smollm2_llm.chat([prompts[0], ASK, prompts[1], ASK], [plain, constrained, plain, constrained])
    assert [c.text for c in crowd] == [alone_plain[0], alone_constrained, alone_plain[1], alone_constrained]
    assert smollm2_llm.engine.compile_count() == compiled


def test_each_constrained_token_is_sampled_while_the_next_decode_is_already_queued(smollm2_llm, monkeypatch):
    """The host reads a constrained token only after the decode that feeds it is dispatched: the
    device never waits for the host's allowed set (only the last token, with nothing after it)."""
    engine = smollm2_llm.engine
    log = []

    dispatch = engine.device.dispatch

    def recording(program, inputs, chunk=None):
        out = dispatch(program, inputs, chunk)
        if program.kind in ("sample", "decode"):
            log.append((program.kind, out.rows))  # kept alive: compared by identity
        return out

    monkeypatch.setattr(engine.device, "dispatch", recording)
    commit = engine._commit
    reading = lambda pending: (log.append(("read", pending.out)), commit(pending))
    monkeypatch.setattr(engine, "_commit", reading)
    samples_before = engine.dispatch_counts.sample_dispatches
    tokens = 30
    held = SamplingParams(temperature=0, regex="[a-z ]{400}", max_tokens=tokens, ignore_eos=True)
    assert len(smollm2_llm.generate(["Letters:"], held)[0].token_ids) == tokens
    samples = [i for i, (kind, _) in enumerate(log) if kind == "sample"]
    assert len(samples) == engine.dispatch_counts.sample_dispatches - samples_before == tokens - 1
    read_at = [
        next(j for j in range(i, len(log)) if log[j][0] == "read" and log[j][1] is log[i][1]) for i in samples
    ]
    late = [
        i for i, j in zip(samples, read_at, strict=True) if "decode" not in [kind for kind, _ in log[i:j]]
    ]
    assert late == samples[-1:], (late, samples)


def test_batch_job_lines_may_carry_a_constraint(smollm2_llm, tmp_path):
    lines = [
        {"id": "json", "messages": ASK, "sampling": {"json_schema": PERSON, "max_tokens": 120}},
        {"id": "code", "prompt": "Code:", "sampling": {"regex": CODE, "max_tokens": 20}},
        {"id": "bad", "prompt": "Code:", "sampling": {"regex": "[0-9"}},
    ]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_jsonl(smollm2_llm, str(source), str(output), SamplingParams(temperature=0), progress=None)
    records = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    jsonschema.validate(json.loads(records["json"]["text"]), PERSON)
    assert re.fullmatch(CODE, records["code"]["text"])
    assert "regex" in records["bad"]["error"]
