"""The engine on the paged KV pool: prefix hits, many sequences in a small pool, preemption; every
output the same as the request alone with nothing cached."""

import numpy as np
import pytest
from tiny import VOCAB

import jinfer

GREEDY = jinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = jinfer.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
PENALISED = jinfer.SamplingParams(
    max_tokens=12, temperature=0.8, seed=5, repetition_penalty=1.4, presence_penalty=0.6,
    frequency_penalty=0.3, ignore_eos=True,
)  # fmt: skip
SAMPLINGS = [GREEDY, SEEDED, PENALISED]


def _prompt(seed, length):
    return np.random.RandomState(seed).randint(0, VOCAB, length).tolist()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama_gqa_untied")[0]


@pytest.fixture(scope="module")
def uncached(model):
    """The reference: each request alone, nothing ever cached."""
    llm = jinfer.LLM(model, max_slots=1, max_seq_len=256, max_num_batched_tokens=64, prefix_caching=False)

    def alone(prompts, samplings):
        return [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, samplings, strict=True)]

    return alone


@pytest.mark.parametrize("budget", [64, 512], ids=["one-piece", "eight-pieces"])
def test_prefix_hits_give_the_tokens_computed_from_scratch(model, uncached, budget):
    """A shared system prompt, a second chat turn (the first turn's prompt and answer, then more),
    the same prompt twice in one batch: greedy, seeded and penalised requests find their prefix in
    the cache, compute only the rest, and give the tokens they give with nothing cached."""
    llm = jinfer.LLM(
        model,
        max_slots=4,
        max_seq_len=256,
        page_size=16,
        max_num_batched_tokens=budget,
        decode_steps=2,
    )
    system = _prompt(1, 70)  # longer than a piece: cached over several pieces
    first_turns = [system + _prompt(10 + i, 5 + 3 * i) for i in range(3)]
    first = llm.generate(first_turns, SAMPLINGS)
    assert [o.token_ids for o in first] == uncached(first_turns, SAMPLINGS)
    answers = [o.token_ids for o in first]
    second_turns = [
        t + a + _prompt(20 + i, 9) for i, (t, a) in enumerate(zip(first_turns, answers, strict=True))
    ]
    twice = system + _prompt(30, 11)
    prompts = [*second_turns, twice, twice]
    samplings = [*SAMPLINGS, SEEDED, PENALISED]
    second = llm.generate(prompts, samplings)
    assert [o.token_ids for o in second] == uncached(prompts, samplings)
    cached = [o.metrics["cached_prompt_tokens"] for o in second]
    for turn, prior, hit in zip(second_turns, first_turns, cached[:3], strict=False):
        # At least the first turn's whole pages but its last (whose positions turn 2 may tokenize anew).
        page = llm.engine.layout.page_size
        assert hit >= (len(prior) + 12 - 1) // page * page - page and hit % page == 0 and hit < len(turn)
    assert cached[3] >= 64 and cached[4] >= 64  # the system prompt's pages, at least
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] >= sum(cached) and stats["kv_pages_used"] == 0


def test_salted_requests_find_only_their_own_prefixes(model):
    llm = jinfer.LLM(model, max_slots=2, max_seq_len=128, page_size=16)
    engine, prompt = llm.engine, _prompt(3, 40)
    done = []

    def run(salt):
        engine.submit(engine.preparer.prepare(prompt, sampling=GREEDY, cache_salt=salt), done.append)
        engine.run_until_idle()
        return done[-1].metrics["cached_prompt_tokens"]

    assert [run("a"), run("b"), run("a"), run(None), run(None)] == [0, 0, 32, 0, 32]


def test_a_pool_for_four_full_sequences_runs_thirty_two_at_once(model, uncached):
    """kv_cache_tokens = 4 x max_seq_len: 32 short requests all decode at once (the running gauge
    reaches 32), each giving its solo tokens; afterwards every slot and page is free."""
    llm = jinfer.LLM(
        model, max_slots=32, max_seq_len=256, kv_cache_tokens=1024, page_size=8,
        decode_steps=1, max_num_batched_tokens=512,
    )  # fmt: skip
    engine = llm.engine
    prompts = [_prompt(100 + i, 6 + i % 7) for i in range(32)]
    samplings = [dataclass_replace(SAMPLINGS[i % 3], max_tokens=6) for i in range(32)]
    outputs = [[] for _ in prompts]
    for i, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        engine.submit(engine.preparer.prepare(p, sampling=s), lambda e, i=i: outputs[i].extend(e.token_ids))
    most = 0
    while engine.scheduler.has_work or engine._pending:
        engine.step()
        most = max(most, engine.stats()["running"])
    assert most == 32
    assert outputs == uncached(prompts, samplings)
    stats = engine.stats()
    assert (stats["slots_in_use"], stats["kv_pages_used"], stats["preemptions"]) == (0, 0, 0)


def dataclass_replace(sampling, **changes):
    import dataclasses

    return dataclasses.replace(sampling, **changes)


@pytest.mark.parametrize(
    ("budget", "decode_steps"), [(64, 1), (512, 1), (512, 4)], ids=["one-piece", "eight-pieces", "4-steps"]
)
def test_out_of_pages_requests_are_preempted_and_resume_with_the_same_tokens(
    model, uncached, budget, decode_steps
):
    """A pool for two full-length sequences, eight long generations: sequences are preempted and
    resumed (from the prefix cache) until all complete, each with exactly its solo tokens."""
    llm = jinfer.LLM(
        model, max_slots=8, max_seq_len=128, kv_cache_tokens=256, page_size=16,
        max_num_batched_tokens=budget, decode_steps=decode_steps,
    )  # fmt: skip
    prompts = [_prompt(200 + i, 10 + 3 * i) for i in range(8)]
    samplings = [dataclass_replace(SAMPLINGS[i % 3], max_tokens=90) for i in range(8)]
    results = llm.generate(prompts, samplings)
    assert [r.finish_reason for r in results] == ["length"] * 8
    assert [r.token_ids for r in results] == uncached(prompts, samplings)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and sum(r.metrics["preemptions"] for r in results) == stats["preemptions"]
    assert (stats["slots_in_use"], stats["kv_pages_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)


def test_constrained_requests_are_preempted_and_resume_with_the_same_tokens(model, uncached):
    """Constrained requests (one token per dispatch, their tokens read before each plan) beside
    four-step ones, in a pool that preempts: each gets its solo tokens, and the grammar holds."""
    import re

    llm = jinfer.LLM(
        model, max_slots=8, max_seq_len=128, kv_cache_tokens=256, page_size=16, decode_steps=4,
    )  # fmt: skip
    letters = jinfer.SamplingParams(
        max_tokens=90, temperature=0.9, seed=3, regex="[a-z ]{400}", ignore_eos=True
    )
    prompts = [_prompt(300 + i, 10 + 3 * i) for i in range(8)]
    samplings = [letters if i % 2 else dataclass_replace(SAMPLINGS[i % 3], max_tokens=90) for i in range(8)]
    results = llm.generate(prompts, samplings)
    assert [r.token_ids for r in results] == uncached(prompts, samplings)
    assert all(re.fullmatch("[a-z ]{90,400}", r.text) for r in results[1::2])
    assert llm.engine.stats()["preemptions"] > 0


def test_background_work_alone_decodes_a_step_a_dispatch_and_gets_its_solo_tokens(model, uncached):
    """Requests less urgent than the default priority, alone: prompts one piece a dispatch, decode
    dispatches of one step (the decode program runs only the steps its rows ask), one in flight at
    a time; greedy, seeded and penalised tokens the same as alone at the default priority."""
    llm = jinfer.LLM(model, max_slots=4, max_seq_len=256, max_num_batched_tokens=256, decode_steps=4)
    engine, plan = llm.engine, llm.engine.scheduler.plan
    in_flight_at_plan = []  # what the device still had to deliver when each plan was made

    def counting_plan():
        in_flight_at_plan.append(len(engine._pending))
        return plan()

    engine.scheduler.plan = counting_plan
    prompts = [_prompt(500 + i, 70 + 5 * i) for i in range(3)]  # two pieces each
    items = [
        llm.preparer.prepare(p, sampling=s, priority=2**30) for p, s in zip(prompts, SAMPLINGS, strict=True)
    ]
    results = dict(llm.iter_completions(items))
    assert len(in_flight_at_plan) > 10 and not any(in_flight_at_plan)
    assert [results[i].token_ids for i in range(3)] == uncached(prompts, SAMPLINGS)
    counts = llm.engine.dispatch_counts
    assert counts.prefill_dispatches >= 6 and counts.prefill_tokens == sum(map(len, prompts))
    assert counts.decode_dispatches > 0 and counts.decode_steps == counts.decode_dispatches


def test_a_request_of_higher_priority_preempts_and_every_request_gets_its_solo_tokens(model, uncached):
    """Two slots held by low-priority generations; an urgent request arrives and takes one at once
    (the latest admitted of the lowest priority is preempted); all three get their solo tokens."""
    llm = jinfer.LLM(model, max_slots=2, max_seq_len=128, max_num_batched_tokens=64, decode_steps=4)
    engine = llm.engine
    prompts = [_prompt(400 + i, 12 + i) for i in range(3)]
    samplings = [dataclass_replace(s, max_tokens=40) for s in SAMPLINGS]
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def submit(i, priority):
        prepared = llm.preparer.prepare(prompts[i], sampling=samplings[i], priority=priority)
        request = engine.make_request(prepared, lambda out, i=i: tokens[i].extend(out.token_ids))
        engine.enqueue(request)
        return request

    low = [submit(0, 5), submit(1, 5)]
    for _ in range(3):
        engine.step()
    assert all(r.slot is not None and not r.finished for r in low)
    urgent = submit(2, 0)
    engine.step()
    assert urgent.slot is not None and low[1].slot is None  # at once, in the latest admitted's slot
    while not all(r.finished for r in (*low, urgent)):
        engine.step()
    assert [tokens[i] for i in range(3)] == uncached(prompts, samplings)
    assert (low[0].preemptions, low[1].preemptions, urgent.preemptions) == (0, 1, 0)
