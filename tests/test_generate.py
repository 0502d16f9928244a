"""LLM.generate on a tiny model: stop conditions, logprobs, seeds, logit bias, defaults, bf16."""

import json
import shutil

import numpy as np
import pytest

import jinfer

PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_seq_len=128)


def _sampled_logprobs(out) -> np.ndarray:
    return np.array([entry["logprob"] for entry in out.logprobs], np.float32)


def test_logprobs_equal_score_of_the_generated_sequence(llm):
    (out,) = llm.generate(
        [PROMPT], jinfer.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    )
    (scores,) = llm.score([PROMPT + out.token_ids])
    assert np.array_equal(_sampled_logprobs(out), scores[len(PROMPT) - 1 :])
    for entry in out.logprobs:
        assert len(entry["top"]) == 3
        assert max(entry["top"].values()) == entry["logprob"]  # greedy picks the top one


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.8, "seed": 3}])
def test_raw_logprobs_of_sampled_tokens_are_their_scores_bit_for_bit_alone_and_in_a_crowd(llm, sampling):
    """What a trainer recomputes (`score`) is what the sampler reported: through the engine's
    attention kernel both are the same prefill and decode arithmetic."""
    assert llm.engine.layout.attention_kernel == "cpu"
    params = jinfer.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, **sampling)
    prompts = [PROMPT, list(range(3, 70)), [7] * 12, PROMPT[:2]]
    (alone,) = llm.generate([prompts[1]], params)
    crowd = llm.generate(prompts, params)
    assert crowd[1].token_ids == alone.token_ids
    assert np.array_equal(_sampled_logprobs(crowd[1]), _sampled_logprobs(alone))
    for prompt, out in zip(prompts, crowd, strict=True):
        (scores,) = llm.score([prompt + out.token_ids])
        assert np.array_equal(_sampled_logprobs(out), scores[len(prompt) - 1 :])


def test_seeded_sampling_is_reproducible(llm):
    sampled = jinfer.SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], sampled)
    assert a.token_ids == b.token_ids
    c = llm.generate(
        [PROMPT], jinfer.SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True)
    )[0]
    assert c.token_ids != a.token_ids


def test_logit_bias_and_stop_token_ids(llm):
    biased = jinfer.SamplingParams(max_tokens=5, temperature=0, logit_bias={77: 100.0}, ignore_eos=True)
    assert llm.generate([PROMPT], biased)[0].token_ids == [77] * 5
    stopping = jinfer.SamplingParams(max_tokens=5, logit_bias={77: 100.0}, stop_token_ids=[77])
    out = llm.generate([PROMPT], stopping)[0]
    assert out.token_ids == [] and out.finish_reason == "stop"


def test_the_stop_token_that_ends_the_output_has_its_log_prob_when_they_are_asked(llm):
    """An evaluation harness sums every generated token's log-prob, the end of sequence's too: with
    log-probs asked, the stop token is the output's last token, with the score's entry bit for bit
    and no text; without, it is left out as before."""
    eos = llm.eos_token_ids[0]
    ask = {"max_tokens": 4, "temperature": 0, "logit_bias": {eos: 100.0}}
    (ended,) = llm.generate([PROMPT], jinfer.SamplingParams(**ask, logprobs=2))
    assert ended.token_ids == [eos] and ended.finish_reason == "stop" and ended.text == ""
    (scores,) = llm.score([[*PROMPT, eos]])
    assert np.array_equal(_sampled_logprobs(ended), scores[-1:])  # raw: the bias is not in it
    assert ended.metrics["completion_tokens"] == 1
    (plain,) = llm.generate([PROMPT], jinfer.SamplingParams(**ask))
    assert plain.token_ids == [] and plain.finish_reason == "stop" and plain.metrics["completion_tokens"] == 0
    stopping = jinfer.SamplingParams(max_tokens=4, logit_bias={77: 100.0}, stop_token_ids=[77], logprobs=0)
    assert llm.generate([PROMPT], stopping)[0].token_ids == [77]


def test_min_tokens_holds_back_stop_tokens(llm):
    sp = jinfer.SamplingParams(
        max_tokens=6, temperature=0, logit_bias={77: 100.0}, stop_token_ids=[77], min_tokens=3
    )
    out = llm.generate([PROMPT], sp)[0]
    assert len(out.token_ids) == 3 and 77 not in out.token_ids and out.finish_reason == "stop"


def test_stop_string_is_cut_from_the_text(llm):
    free = llm.generate([PROMPT], jinfer.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate(
        [PROMPT], jinfer.SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]


def test_generation_config_sets_defaults_and_eos(tiny_model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model("llama_gqa_untied")[0], target)
    (target / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": [77, 78]}))
    llm = jinfer.LLM(str(target))
    assert llm.default_sampling.temperature == 0.0
    assert {77, 78} <= set(llm.eos_token_ids)
    biased = jinfer.SamplingParams(max_tokens=5, temperature=0, logit_bias={78: 100.0})
    assert llm.generate([PROMPT], biased)[0].finish_reason == "stop"


def test_bfloat16_weights_generate_close_to_float32(tiny_model, llm):
    bf16 = jinfer.LLM(tiny_model("llama_gqa_untied")[0], dtype="bfloat16", max_seq_len=128)
    assert bf16.params.embed.dtype.name == "bfloat16"
    ours, reference = bf16.score([PROMPT * 4])[0], llm.score([PROMPT * 4])[0]
    assert ours.dtype == np.float32
    assert np.abs(ours - reference).max() < 0.1 * np.abs(reference).max()
