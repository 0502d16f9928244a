"""The engine on tiny real models: batch invariance, chunked prefill, sharding, compiles, policies."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import VOCAB

import jinfer
from jinfer.models import llama
from jinfer.prepare import ContextLengthError
from jinfer.scheduler import QueueFullError


def _submit(engine, prompt_ids, sampling, sink, **options):
    """Submit token ids through the engine's request-preparation path, as every door does."""
    return engine.submit(engine.preparer.prepare(prompt_ids, sampling=sampling), sink, **options)


GREEDY = jinfer.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = jinfer.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


def _prompt(seed, length):
    return np.random.RandomState(seed).randint(0, VOCAB, length).tolist()


def _cotenant(seed):
    """A random neighbour: random length and random sampling settings."""
    rng = np.random.RandomState(seed)
    sampling = jinfer.SamplingParams(
        max_tokens=int(rng.randint(4, 24)),
        temperature=float(rng.choice([0.0, 0.7, 1.3])),
        top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.8])),
        repetition_penalty=float(rng.choice([1.0, 1.3])),
        presence_penalty=float(rng.choice([0.0, 0.5])),
        logprobs=int(rng.choice([0, 3])) if rng.rand() < 0.5 else None,
        ignore_eos=True,
        logprobs_mode=str(rng.choice(["raw", "processed"])),
    )
    return _prompt(seed + 1000, int(rng.randint(3, 60))), sampling


@pytest.fixture(scope="module")
def llm(tiny_model):
    return jinfer.LLM(
        tiny_model("llama_gqa_untied")[0], max_slots=4, max_seq_len=128, max_num_batched_tokens=64
    )


def _greedy_reference(llm, prompt, n):
    """Greedy tokens from repeated full forward passes (no cache, no engine), padded to 128."""
    cfg = llm.engine.steps.model

    @jax.jit
    def next_token(params, tokens, length):
        hidden, _ = llama.forward(params, tokens, jnp.arange(tokens.shape[1])[None], cfg)
        last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)
        return jnp.argmax(llama.logits(params, last)[0, :VOCAB])

    ids = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, 128), np.int32)
        tokens[0, : len(ids)] = ids
        ids.append(int(next_token(llm.params, tokens, len(ids))))
    return ids[len(prompt) :]


def test_engine_greedy_equals_full_forward_reference_with_chunked_prefill(llm):
    for length in (5, 31, 70):  # 70 > the budget (64): prefilled over two iterations
        prompt = _prompt(length, length)
        (out,) = llm.generate([prompt], GREEDY)
        assert out.token_ids == _greedy_reference(llm, prompt, 16), length


@pytest.fixture(scope="module")
def mixing_llm(tiny_model):
    """One decode step a dispatch (the `llm` fixture's decode dispatches scan 4): either way
    decode rows ride in the prompt pieces' dispatch, one step, whenever both run."""
    llm = jinfer.LLM(
        tiny_model("llama_gqa_untied")[0],
        max_slots=4,
        max_seq_len=128,
        max_num_batched_tokens=64,
        decode_steps=1,
        packed_weights=True,
    )
    assert llm.engine.layout.mixed_rows == (4,)
    return llm


@pytest.mark.parametrize("engine", ["llm", "mixing_llm"], ids=["4-steps", "1-step"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batch_invariance_in_every_slot(request, engine, sampling):
    """Alone, a request's decode tokens come from decode dispatches (scans of 4 steps with `llm`);
    among neighbours some come from the one step its row takes in their prompts' dispatches: the
    same tokens."""
    llm = request.getfixturevalue(engine)
    mixed_before = llm.engine.dispatch_counts.mixed_dispatches
    target = _prompt(7, 21)
    (alone,) = llm.generate([target], sampling)
    for slot in range(4):
        neighbours = [_cotenant(10 * slot + i) for i in range(6)]
        prompts = [p for p, _ in neighbours]
        samplings = [s for _, s in neighbours]
        prompts.insert(slot, target)
        samplings.insert(slot, sampling)
        results = llm.generate(prompts, samplings)
        assert results[slot].token_ids == alone.token_ids, slot
    assert llm.engine.dispatch_counts.mixed_dispatches > mixed_before


@pytest.mark.parametrize("engine", ["llm", "mixing_llm"], ids=["4-steps", "1-step"])
def test_processed_logprobs_are_of_the_sampled_distribution_alone_and_in_a_crowd(request, engine):
    """logprobs_mode "processed" changes what the log-probs are of, never the tokens: the seeded
    tokens are raw mode's; each token's alternatives are its top-k set, the token among them, their
    probabilities summing to 1; alone and among neighbours (raw and processed) the same bits."""
    llm = request.getfixturevalue(engine)
    raw = dataclasses.replace(SEEDED, top_k=3, top_p=1.0, logprobs=5)
    processed = dataclasses.replace(raw, logprobs_mode="processed")
    target = _prompt(11, 30)
    (alone_raw,) = llm.generate([target], raw)
    (alone,) = llm.generate([target], processed)
    assert alone.token_ids == alone_raw.token_ids
    for entry, token in zip(alone.logprobs, alone.token_ids, strict=True):
        assert entry["token_id"] == token and len(entry["top"]) == 3
        assert entry["top"][token] == entry["logprob"]
        assert abs(np.logaddexp.reduce(list(entry["top"].values()))) < 1e-5
    assert [e["logprob"] for e in alone.logprobs] != [e["logprob"] for e in alone_raw.logprobs]
    neighbours = [_cotenant(70 + i) for i in range(5)]
    prompts, samplings = [target] + [p for p, _ in neighbours], [processed] + [s for _, s in neighbours]
    (crowded, *_) = llm.generate(prompts, samplings)
    assert crowded.token_ids == alone.token_ids and crowded.logprobs == alone.logprobs


@pytest.mark.parametrize("slots,steps", [(32, 4), (64, 4), (32, 1)], ids=["32", "64", "32-mixed"])
def test_log_probs_are_batch_invariant_in_the_widest_decode_steps(tiny_model, slots, steps):
    """A request's log-probs are the same bits alone and beside a crowd filling every row of the
    decode step (32, or 64: past 32 the packed kernel multiplies from cached panels; or 32 rows
    sharing their products with prompt pieces, one decode step a dispatch); compared exactly,
    since a greedy token alone would hide a difference in the last bits."""
    llm = jinfer.LLM(
        tiny_model("llama_gqa_untied")[0],
        max_slots=slots,
        max_seq_len=128,
        kv_cache_tokens=slots * 128,
        packed_weights=True,
        decode_steps=steps,
    )
    assert llm.engine.layout.packed_weights and llm.engine.layout.slot_buckets[-1] == slots
    target = _prompt(7, 21)
    sampling = dataclasses.replace(GREEDY, logprobs=3)
    (alone,) = llm.generate([target], sampling)
    neighbours = [_cotenant(500 + i) for i in range(slots - 9)]
    prompts = [target] + [p for p, _ in neighbours]
    samplings = [sampling] + [dataclasses.replace(s, max_tokens=24) for _, s in neighbours]
    dispatched, dispatch = [], llm.engine.device.dispatch
    llm.engine.device.dispatch = lambda program, *args: dispatched.append(program) or dispatch(program, *args)
    results = llm.generate(prompts, samplings)
    kind = "decode" if steps > 1 else "mixed"
    assert max(p.rows for p in dispatched if p.kind == kind) == slots  # every row of the widest
    assert results[0].token_ids == alone.token_ids and results[0].logprobs == alone.logprobs


@pytest.mark.parametrize(
    "budget,steps", [(64, 4), (256, 4), (256, 1)], ids=["one-piece", "four-pieces", "mixed"]
)
def test_no_recompiles_after_warmup(tiny_model, budget, steps):
    llm = jinfer.LLM(
        tiny_model("qwen2_bias_tied")[0],
        max_slots=4,
        max_seq_len=128,
        decode_steps=steps,
        max_num_batched_tokens=budget,
        kv_cache_tokens=256,  # two full-length sequences: the crowd below is preempted at times
        page_size=16,
    )
    llm.engine.warmup()
    before = llm.engine.compile_count()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if "backend_compile" in event else None
    )
    prompts, samplings = zip(*[_cotenant(s) for s in range(12)], strict=True)
    samplings = list(samplings)
    samplings[0] = jinfer.SamplingParams(max_tokens=5, logit_bias={3: 2.0}, stop=["ab"], min_tokens=2)
    # One long prompt (chunked), and one prompt twice (found in the prefix cache), all growing
    # long: together more than the pool holds.
    long = jinfer.SamplingParams(max_tokens=100, temperature=0.5, seed=3, ignore_eos=True)
    prompts = [*prompts[:-1], _prompt(99, 100), _prompt(98, 20), _prompt(97, 20), _prompt(98, 20)]
    samplings[-1:] = [dataclasses.replace(long, max_tokens=20), long, long, long]
    results = llm.generate(list(prompts), samplings)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert llm.engine.dispatch_counts.mixed_dispatches > 0  # one decode step, whatever `steps`
    assert llm.engine.compile_count() == before
    assert compiles == []


def test_the_warm_up_builds_each_program_once(tiny_model):
    """Compiled all at once ahead of their calls (`Device._compile_programs`): the calls that follow
    run those executables, so none is built a second time for its calls' arguments (XLA builds
    counted, compiled or loaded from the compile cache; the history and page-clearing verbs, unless
    this process built them for an engine of the same shapes before)."""
    from jinfer.compile_cache import tally

    llm = jinfer.LLM(
        tiny_model("llama_gqa_untied")[0], max_slots=2, max_seq_len=64, max_num_batched_tokens=64,
        page_size=16,
    )  # fmt: skip
    before = tally()
    llm.engine.warmup()
    built = tally().since(before)
    programs = len(llm.engine.steps.programs)
    assert programs <= built.programs <= programs + 2
    assert len(llm.engine.device.executables) == programs
    before = tally()
    llm.generate(["one two", "three"], jinfer.SamplingParams(max_tokens=4, temperature=0))
    assert tally().since(before).programs == 0


def test_prompts_arriving_while_others_decode_share_a_dispatch_and_give_the_same_tokens(
    tiny_model, monkeypatch
):
    # max_seq_len 100 is no multiple of the 64-token pieces: the last piece's padding runs past the
    # sequence's pages (and is dropped). No prefix caching: every prompt is computed from its start.
    llm = jinfer.LLM(
        tiny_model("llama_gqa_untied")[0],
        max_slots=4,
        max_seq_len=100,
        max_num_batched_tokens=192,
        decode_steps=2,
        prefix_caching=False,
    )
    engine = llm.engine
    seeded_prompt = _prompt(2, 21)
    (seeded_alone,) = llm.generate([seeded_prompt], SEEDED)
    pieces = []  # (dispatch, slot, start, length, last) of every piece prefilled from here on

    dispatch = engine.device.dispatch

    def recording(program, inputs, chunk=None):
        if program.kind in ("prefill", "mixed"):
            rows = zip(chunk.slot, chunk.start, chunk.length, chunk.last, strict=True)
            pieces.extend((len(engine.device_calls), *map(int, row)) for row in rows if row[2])
        engine.device_calls.append(program.kind)
        return dispatch(program, inputs, chunk)

    engine.device_calls = []
    monkeypatch.setattr(engine.device, "dispatch", recording)
    first, near_end = _prompt(1, 10), _prompt(3, 97)
    outputs = {}
    sink = lambda name: lambda event: outputs.setdefault(name, []).extend(event.token_ids)
    _submit(
        engine, first, jinfer.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), sink("first")
    )
    for _ in range(2):
        engine.step()
    _submit(engine, seeded_prompt, SEEDED, sink("seeded"))
    _submit(
        engine,
        near_end,
        jinfer.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        sink("near_end"),
    )
    engine.run_until_idle()
    by_slot = {}
    for _, slot, start, length, last in pieces[1:]:  # after the first prompt's own piece
        by_slot.setdefault(slot, []).append((start, length, last))
    for chunks in by_slot.values():  # each prompt went in consecutive pieces from position 0
        starts = [sum(c[1] for c in chunks[:i]) for i in range(len(chunks))]
        assert [start for start, _, _ in chunks] == starts
        assert [last for _, _, last in chunks] == [False] * (len(chunks) - 1) + [True]  # only it has logits
    assert sorted(sum(c[1] for c in chunks) for chunks in by_slot.values()) == [21, 97]
    # Two whole pieces a dispatch (the first's decode row, one step beside them, takes 1 of the
    # 192): the seeded prompt and the long prompt's first piece in one, its second piece (33
    # tokens, padded to 128 > 100) in the next.
    dispatches = [d for d, *_ in pieces[1:]]
    assert dispatches[0] == dispatches[1] != dispatches[2]
    assert engine.device_calls[dispatches[0]] == engine.device_calls[dispatches[2]] == "mixed"
    assert engine.dispatch_counts.prefill_tokens == 10 + 21 + 21 + 97
    assert outputs["first"] == _greedy_reference(llm, first, 40)
    assert outputs["seeded"] == seeded_alone.token_ids
    assert outputs["near_end"] == _greedy_reference(llm, near_end, 3)


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "constrained"])
def test_cancel_frees_the_slot_within_one_step(llm, constrained):
    """A constrained request is cancelled while its decode row waits to be sampled (deferred)."""
    engine = llm.engine
    events = []
    held = {"regex": "[a-z ]{400}"} if constrained else {}
    request = _submit(
        engine, _prompt(1, 10), jinfer.SamplingParams(max_tokens=100, ignore_eos=True, **held), events.append
    )
    other = []
    _submit(
        engine,
        _prompt(2, 10),
        jinfer.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        other.append,
    )
    for _ in range(3):
        engine.step()
    assert request.slot is not None and engine.scheduler.slots[request.slot] is request
    assert (engine.dispatcher.deferred is not None) == constrained
    engine.cancel(request.request_id)
    engine.step()
    assert request not in engine.scheduler.slots
    assert events[-1].finished and events[-1].finish_reason == "abort"
    engine.run_until_idle()
    assert other[-1].finish_reason == "length" and sum(len(e.token_ids) for e in other) == 6
    assert engine.scheduler.slots == [None] * 4 and not engine.scheduler.waiting


def test_queue_full_rejects_and_accepted_requests_complete(tiny_model):
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=2, max_queue=2, max_seq_len=64)
    engine = llm.engine
    finals = []
    sink = lambda e: finals.append(e) if e.finished else None
    sampling = jinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    _submit(engine, [1, 2, 3], sampling, sink)
    _submit(engine, [4, 5, 6], sampling, sink)
    with pytest.raises(QueueFullError, match="queue is full"):
        _submit(engine, [7, 8, 9], sampling, sink)
    engine.run_until_idle()
    assert [e.finish_reason for e in finals] == ["length", "length"]


def test_context_policies(llm):
    long_prompt = _prompt(3, 120)
    with pytest.raises(
        ContextLengthError, match="context window is 128 tokens, but the prompt has 120 tokens"
    ):
        llm.generate([long_prompt], jinfer.SamplingParams(max_tokens=20))
    (out,) = llm.generate(
        [long_prompt], jinfer.SamplingParams(max_tokens=20, temperature=0), context_policy="truncate"
    )
    assert out.metrics["dropped_prompt_tokens"] == 12 and out.prompt_token_ids == long_prompt[12:]
    assert len(out.token_ids) == 20
    (window,) = llm.generate(
        [_prompt(4, 100)], jinfer.SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    )
    assert len(window.token_ids) == 28 and window.finish_reason == "length"  # "up to the window"

    system = {"role": "system", "content": "Be brief."}
    history = [{"role": r, "content": "Once upon a time " * 8} for r in ("user", "assistant") * 3]
    question = {"role": "user", "content": "What is the capital of France?"}
    conversation = [system, *history, question]
    with pytest.raises(ContextLengthError):
        llm.chat([conversation], jinfer.SamplingParams(max_tokens=8))
    (answer,) = llm.chat([conversation], jinfer.SamplingParams(max_tokens=8), context_policy="drop_oldest")
    assert answer.metrics["dropped_messages"] >= 1
    kept = llm.tokenizer.decode(answer.prompt_token_ids, skip_special_tokens=False)
    assert kept.startswith("<|im_start|>system\nBe brief.") and "capital of France" in kept


def test_stop_string_split_across_tokens_is_held_back_and_cut(llm):
    (free,) = llm.generate(
        [_prompt(5, 9)], jinfer.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    whole = lambda piece: piece.strip() and "\ufffd" not in piece
    i = next(i for i in range(2, len(pieces) - 1) if whole(pieces[i]) and whole(pieces[i + 1]))
    stop = pieces[i][-1] + pieces[i + 1][0]
    expected = free.text[: free.text.find(stop)]
    events = []
    sampling = jinfer.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    _submit(llm.engine, _prompt(5, 9), sampling, events.append)
    llm.engine.run_until_idle()
    streamed = "".join(e.text for e in events)
    assert streamed == expected and stop not in streamed
    assert events[-1].finish_reason == "stop"


def test_nan_logits_end_only_that_request(tiny_model):
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=4, max_seq_len=64)
    healthy = [_prompt(s, 12) for s in range(3)]
    poison = 13
    engine = llm.engine
    poisoned_embed = engine.params.embed.at[poison].set(np.nan)
    engine.device.weights = engine.device.weights.replace(target=engine.params.replace(embed=poisoned_embed))
    clean = [[t for t in p if t != poison] for p in healthy]
    alone = [o.token_ids for o in llm.generate(clean, GREEDY)]
    poisoned = [1, poison, *clean[0] * 3]  # NaN K/V reach past where a short prompt would overwrite them
    results = llm.generate([clean[0], poisoned, clean[1], clean[2]], GREEDY)
    assert results[1].finish_reason == "error" and "NaN" in results[1].error and results[1].token_ids == []
    assert [results[i].token_ids for i in (0, 2, 3)] == alone
    # The poisoned slot is clean again for the next request that gets it.
    again = llm.generate([*clean, clean[0]], GREEDY)
    assert [o.token_ids for o in again] == [*alone, alone[0]]


def test_device_failure_fails_touched_requests_and_engine_keeps_serving(llm, monkeypatch):
    engine = llm.engine
    calls = {"n": 0}

    dispatch = engine.device.dispatch

    def failing_on_second_decode(program, inputs, chunk=None):
        calls["n"] += program.kind == "decode"
        if program.kind == "decode" and calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return dispatch(program, inputs, chunk)

    monkeypatch.setattr(engine.device, "dispatch", failing_on_second_decode)
    first = llm.generate([_prompt(1, 8), _prompt(2, 8)], GREEDY)
    assert [r.finish_reason for r in first] == ["error", "error"]
    assert "simulated device fault" in first[0].error
    monkeypatch.undo()
    (after,) = llm.generate([_prompt(7, 21)], GREEDY)
    assert after.finish_reason == "length" and after.token_ids == _greedy_reference(llm, _prompt(7, 21), 16)


def test_metrics_report_queue_ttft_and_inter_token_times(llm):
    (out,) = llm.generate([_prompt(8, 10)], GREEDY)
    m = out.metrics
    assert m["prompt_tokens"] == 10 and m["completion_tokens"] == 16
    assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["total_s"]
    assert len(m["inter_token_s"]) == 15 and all(t >= 0 for t in m["inter_token_s"])


def test_a_pool_that_cannot_fit_is_refused_with_one_that_would_and_auto_shrinks_to_fit(tiny_model):
    path = tiny_model("llama_gqa_untied")[0]
    refused = r"kv_cache_tokens=\d+ needs .* but only .* is available.*kv_cache_tokens=\d+ would fit"
    with pytest.raises(ValueError, match=refused):
        jinfer.LLM(path, max_slots=4, max_seq_len=256, kv_cache_tokens=10**6, memory_fraction=1e-4)
    # Auto on a CPU is max_seq_len x max_slots (at most 8) positions, fewer when they do not fit.
    llm = jinfer.LLM(path, max_slots=4096, max_seq_len=256, memory_fraction=1e-4, packed_weights=False)
    assert 256 <= llm.engine.layout.kv_cache_tokens < 4096 * 256
    assert llm.engine.layout.max_slots == 4096 and llm.engine.layout.max_seq_len == 256


@pytest.mark.parametrize(("data", "model"), [(2, 4), (1, 8)])
def test_sharded_equals_unsharded(tiny_model, data, model):
    directory, _ = tiny_model("smollm2_like")  # 6 query / 2 kv heads: padded to divide the model axis
    options = {"max_slots": 8, "max_seq_len": 128, "max_num_batched_tokens": 128}
    prompts = [_prompt(s, 5 + 9 * s) for s in range(8)]
    samplings = [GREEDY if s % 2 else SEEDED for s in range(8)]
    single = jinfer.LLM(directory, **options)
    sharded = jinfer.LLM(directory, mesh_data=data, mesh_model=model, **options)
    assert len(sharded.params.layers[0].wqkv.sharding.device_set) == data * model
    expected = [o.token_ids for o in single.generate(prompts, samplings)]
    assert [o.token_ids for o in sharded.generate(prompts, samplings)] == expected
    np.testing.assert_allclose(sharded.score([prompts[3]])[0], single.score([prompts[3]])[0], atol=1e-4)


def test_background_loop_serves_submissions_from_other_threads(tiny_model):
    import threading

    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=2, max_seq_len=64)
    expected = [o.token_ids for o in llm.generate([_prompt(s, 6) for s in range(4)], GREEDY)]
    engine = llm.engine
    engine.start()
    try:
        done = [threading.Event() for _ in range(4)]
        tokens = [[] for _ in range(4)]

        def sink_for(i):
            def sink(event):
                tokens[i].extend(event.token_ids)
                if event.finished:
                    done[i].set()

            return sink

        submit = lambda s: _submit(engine, _prompt(s, 6), GREEDY, sink_for(s), block=True)
        threads = [threading.Thread(target=submit, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        assert all(d.wait(timeout=60) for d in done)
        assert tokens == expected
    finally:
        engine.stop()


def test_decode_kernel_path_gives_the_reference_tokens(tiny_model, monkeypatch):
    """The engine wired to the Pallas paged decode kernel (interpreted, so that it computes exactly
    what it would on a GPU, in float32) decodes what the einsum path decodes. (A model without
    sliding windows: the kernel has none, windowed layers attend by XLA.) The real kernel's numbers
    are checked against the einsums in test_kv_cache (on a GPU, in bfloat16)."""
    from jinfer import layout
    from jinfer.kernels import gpu_attention

    monkeypatch.setattr(layout, "attention_kernel", lambda *args: "gpu")
    real = gpu_attention.attention
    options = {"max_slots": 4, "max_seq_len": 256, "max_num_batched_tokens": 128, "decode_steps": 2}
    calls = []
    monkeypatch.setattr(gpu_attention, "attention", lambda *a: (calls.append(a), real(*a, interpret=True))[1])
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], **options)
    assert llm.engine.steps.attention_buckets == (256,)  # the kernel needs no attention buckets
    prompts = [_prompt(s, 5 + 13 * s) for s in range(6)]  # more prompts than slots: some wait
    samplings = [jinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 6
    got = [o.token_ids for o in llm.generate(prompts, samplings)]
    assert calls  # traced into the decode steps
    monkeypatch.undo()
    reference = jinfer.LLM(tiny_model("llama_gqa_untied")[0], decode_kernel=False, **options)
    assert got == [o.token_ids for o in reference.generate(prompts, samplings)]


def test_cpu_attention_kernel_gives_the_einsum_tokens(tiny_model):
    """On a CPU the engine attends with the C++ kernel, decode rows and prompt pieces alike, and
    needs no attention buckets; with decode_kernel=False it attends with XLA's einsums over the
    buckets. Both decode the same greedy tokens (sliding-window model)."""
    options = {"max_slots": 4, "max_seq_len": 256, "max_num_batched_tokens": 128, "decode_steps": 2}
    prompts = [_prompt(s, 5 + 13 * s) for s in range(6)]  # more prompts than slots: some wait
    samplings = [jinfer.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 6
    kernel = jinfer.LLM(tiny_model("mistral_sliding")[0], **options)
    assert kernel.engine.steps.attention_kernel == "cpu"
    assert kernel.engine.steps.attention_buckets == (256,)
    einsum = jinfer.LLM(tiny_model("mistral_sliding")[0], decode_kernel=False, **options)
    assert einsum.engine.steps.attention_kernel is None
    assert einsum.engine.steps.attention_buckets == (64, 128, 256)
    got = [o.token_ids for o in kernel.generate(prompts, samplings)]
    assert got == [o.token_ids for o in einsum.generate(prompts, samplings)]


def test_no_decode_dispatch_computes_only_tokens_past_max_tokens(llm, monkeypatch):
    calls, dispatch = [], llm.engine.device.dispatch

    def counting(program, inputs, chunk=None):
        calls.extend([program] if program.kind == "decode" else [])
        return dispatch(program, inputs, chunk)

    monkeypatch.setattr(llm.engine.device, "dispatch", counting)
    steps = llm.engine.layout.decode_steps
    prompt = _prompt(5, 12)
    for max_tokens in (1, 2, steps + 1, 16):
        calls.clear()
        (out,) = llm.generate(
            [prompt], jinfer.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        # The prefill samples the first token; each decode dispatch `steps` more (the last maybe in part).
        assert len(out.token_ids) == max_tokens
        assert len(calls) == -(-(max_tokens - 1) // steps), max_tokens


@pytest.mark.parametrize("family", ["llama_gqa_untied", "qwen2_bias_tied", "qwen3_qknorm"])
def test_packed_weights_decode_the_same_tokens_and_logprobs(tiny_model, family, monkeypatch):
    """With packed_weights products of up to `MAX_COLUMNS` columns go through the CPU matmul kernel
    (decode steps, the logits of prompts' last tokens; prompt pieces through XLA's dot on the same
    matrices): greedy tokens are the same and their log-probs agree to float32 rounding, with an
    untied output projection or a tied embedding, q/k/v biases and q/k norms; `LLM.params` is the
    model's own weights either way."""
    options = {"max_slots": 4, "max_seq_len": 256, "max_num_batched_tokens": 128, "decode_steps": 2}
    prompts = [_prompt(s, 5 + 13 * s) for s in range(6)]
    samplings = [jinfer.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)] * 6
    from jinfer.kernels import cpu_matmul

    traced = []  # kernel calls placed in compiled programs
    monkeypatch.setattr(
        cpu_matmul, "matmul", lambda *a, real=cpu_matmul.matmul: (traced.append(1), real(*a))[1]
    )
    packed = jinfer.LLM(tiny_model(family)[0], packed_weights=True, **options)
    plain = jinfer.LLM(tiny_model(family)[0], packed_weights=False, **options)
    assert isinstance(packed.engine.params.layers[0].w_down, llama.PackedWeight)
    assert not isinstance(plain.engine.params.layers[0].w_down, llama.PackedWeight)
    same_weights = jax.tree.map(np.array_equal, packed.params, plain.params)
    assert all(jax.tree.leaves(same_weights))
    ran = {}  # per engine, the programs it dispatched
    for name, engine in (("packed", packed.engine), ("plain", plain.engine)):
        dispatch, ran[name] = engine.device.dispatch, set()
        engine.device.dispatch = lambda program, *a, d=dispatch, s=ran[name]: s.add(program) or d(program, *a)
    got, want = packed.generate(prompts, samplings), plain.generate(prompts, samplings)
    assert traced  # the compiled decode steps multiply with the kernel
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    got_lp = np.array([e["logprob"] for o in got for e in o.logprobs])
    want_lp = np.array([e["logprob"] for o in want for e in o.logprobs])
    assert np.abs(got_lp - want_lp).max() < 1e-4
    # Packed, decode rows ride with the prompt pieces (mixed programs); either way one compile a
    # program run, beside the same others.
    assert any(p.kind == "mixed" for p in ran["packed"]) and not any(p.kind == "mixed" for p in ran["plain"])
    extra = lambda name, llm: llm.engine.compile_count() - len(ran[name])
    assert extra("packed", packed) == extra("plain", plain)


def test_dispatch_counts_say_how_full_the_batches_ran(llm):
    engine = llm.engine
    before = dataclasses.asdict(engine.dispatch_counts)
    steps = engine.layout.decode_steps
    sampling = jinfer.SamplingParams(max_tokens=1 + 2 * steps, temperature=0, ignore_eos=True)
    llm.generate([_prompt(7, 12), _prompt(8, 12)], sampling)
    counts = dataclasses.asdict(engine.dispatch_counts)
    delta = {name: counts[name] - before[name] for name in counts}
    rows, mixed_rows = engine.layout.slot_bucket(2), engine.layout.mixed_bucket(1)
    # A budget of 64 takes one piece an iteration: the first prompt; then the second, the first's
    # row riding in its dispatch for one step; then two dispatches of `steps` steps decode both
    # (the first's 1 + 1 + 2 x steps tokens run one past its max_tokens, the last discarded).
    assert delta == {
        "prefill_dispatches": 2,
        "prefill_tokens": 24,
        "prefill_padding": 2 * (64 - 12),
        "mixed_dispatches": 1,
        "decode_dispatches": 3,
        "decode_steps": 1 + 2 * steps,
        "decode_active_row_steps": 1 + 2 * 2 * steps,
        "decode_idle_row_steps": (mixed_rows - 1) + 2 * (rows - 2) * steps,
        "sample_dispatches": 0,  # only constrained rows are sampled on their own
        "verify_dispatches": 0,  # speculation is off
        "draft_tokens": 0,
        "accepted_tokens": 0,
    }
