"""`LLM.update_weights`: new weights swapped in memory between generate calls, through the programs
already compiled, giving what an engine built from those weights gives, bit for bit."""

import dataclasses

import jax
import numpy as np
import pytest

import jinfer
from jinfer.engine import EngineUnavailable
from jinfer.formats.checkpoint import save_checkpoint
from jinfer.formats.hf import load_hf

OPTIONS = {"max_slots": 4, "max_seq_len": 128, "max_num_batched_tokens": 64, "packed_weights": True}
GREEDY = jinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = dataclasses.replace(GREEDY, temperature=0.9, seed=7)
PROMPTS = [list(range(3, 100)), list(range(20, 31))]  # the first fills a page (64) the prefix cache keeps


def _perturbed(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda w: np.asarray(w) + 0.05 * rng.standard_normal(w.shape).astype(w.dtype), params)


def _answers(llm):
    return [(c.token_ids, c.logprobs) for c in llm.generate(PROMPTS * 2, [GREEDY, SEEDED, SEEDED, GREEDY])]


def test_updated_weights_give_what_an_engine_built_from_them_gives(tiny_model, tmp_path):
    """Greedy and seeded answers with log-probs after an update equal those of an engine loaded from
    a checkpoint of the new weights; updating back gives the first answers again (no page the prefix
    cache kept from other weights is reused); no program compiles; each result says its version."""
    directory, _ = tiny_model("llama_gqa_untied")
    loaded = load_hf(directory)
    new = _perturbed(loaded.params, seed=1)
    save_checkpoint(str(tmp_path / "new"), dataclasses.replace(loaded, params=new))
    want = _answers(jinfer.LLM(str(tmp_path / "new"), **OPTIONS))
    llm = jinfer.LLM(directory, **OPTIONS)
    before = _answers(llm)
    hits = llm.engine.kv.hits
    assert before == _answers(llm) and llm.engine.kv.hits > hits  # the second run hit the prefix cache
    # Every program compiled: which ones a run dispatches depends on its prefix hits (the pieces
    # left to compute, and the decode rows riding with them).
    llm.engine.warmup()
    compiles = llm.engine.compile_count()
    assert llm.update_weights(new) == 1
    assert _answers(llm) == want != before
    assert llm.generate([PROMPTS[1]], GREEDY)[0].metrics["weights_version"] == 1
    assert llm.update_weights(loaded.params) == 2
    assert _answers(llm) == before
    assert llm.engine.compile_count() == compiles


def test_weights_of_another_shape_or_dtype_or_tree_are_refused_and_nothing_changes(tiny_model):
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], **OPTIONS)
    before = _answers(llm)
    params = llm.params
    wrong_shape = params.replace(final_norm=np.zeros(params.final_norm.shape[0] + 1, np.float32))
    with pytest.raises(ValueError, match=r"final_norm must be float32\[\d+\]"):
        llm.update_weights(wrong_shape)
    with pytest.raises(ValueError, match="must be float32"):
        llm.update_weights(params.replace(final_norm=np.asarray(params.final_norm, np.float16)))
    with pytest.raises(ValueError, match=r"shaped as LLM\.params"):
        llm.update_weights(params.layers)
    waiting = llm.engine.submit(llm.preparer.prepare(PROMPTS[1], sampling=GREEDY), lambda output: None)
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.update_weights(params)  # a request is in flight
    llm.engine.cancel(waiting.request_id)
    while llm.engine.scheduler.has_work:
        llm.engine.step()
    assert llm.engine.weights_version == 0 and _answers(llm) == before


def _live_bytes() -> int:
    """Bytes of every array alive on the devices (what the process's resident memory can give back
    depends on what else the process holds: scripts/bench_residency.py measures that)."""
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_wake_up_serves_the_same_answers(tiny_model, level):
    """Asleep, the KV cache's arrays are gone (and at level 2 the weights'), a request is refused;
    awake, the answers are the same bits as before,
    with no program compiled again. A level-2 wake-up reads the weights from the model's files."""
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], **OPTIONS, kv_cache_tokens=400_000)
    before, compiles = _answers(llm), llm.engine.compile_count()
    weights = sum(a.nbytes for a in jax.tree.leaves(llm.engine.params))
    awake = _live_bytes()
    llm.sleep(level)
    assert awake - _live_bytes() >= llm.engine.cache_bytes + (weights if level == 2 else 0)
    with pytest.raises(EngineUnavailable, match="asleep"):
        llm.generate([PROMPTS[1]], GREEDY)
    if level == 2:
        with pytest.raises(RuntimeError, match="dropped"):
            llm.score([PROMPTS[1]])
    llm.wake_up()
    llm.wake_up()  # awake: nothing changes
    assert _answers(llm) == before
    assert llm.engine.compile_count() == compiles
    assert llm.engine.weights_version == level - 1  # a level-2 wake-up reloads: a new version


def test_weights_update_right_after_a_call_whose_last_dispatch_was_not_read(smollm2_llm):
    """A chat ends at its end-of-turn token, which leaves the dispatch after it on the device,
    unread; update_weights and sleep read it first rather than refuse an engine that only looks
    busy. The embedded model's quantized weights go through update_weights as they are held."""
    llm = smollm2_llm
    ask = [[{"role": "user", "content": "What is the capital of France?"}]]
    sampling = jinfer.SamplingParams(max_tokens=32, temperature=0)
    answer = llm.chat(ask, sampling)[0]
    assert answer.finish_reason == "stop"
    llm.update_weights(llm.params)
    assert llm.chat(ask, sampling)[0].text == answer.text
    llm.sleep(1)
    llm.wake_up()
    assert llm.chat(ask, sampling)[0].text == answer.text
