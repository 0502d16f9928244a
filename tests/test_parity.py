"""Numerical parity with Hugging Face transformers on tiny random models of every family."""

import numpy as np
import pytest
import torch
from tiny import FAMILIES, VOCAB

import jinfer
from jinfer.formats.hf import load_hf
from jinfer.models import llama


def _reference_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _ids(seed: int, length: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (1, length))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_sequence_logits_match_transformers(family, tiny_model):
    directory, model = tiny_model(family)
    loaded = load_hf(directory)
    ids = _ids(1, 80)  # past the sliding window and past the scaled-rope original context
    ref = _reference_logits(model, ids)
    hidden, _ = llama.forward(loaded.params, ids, np.arange(ids.shape[1])[None], loaded.config)
    ours = np.asarray(llama.logits(loaded.params, hidden))
    scale = np.ptp(ref)
    assert scale > 1.0, "logits too flat for a meaningful comparison"
    assert np.abs(ours - ref).max() <= 1e-4 * scale


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_score_and_greedy_match_transformers(family, tiny_model):
    directory, model = tiny_model(family)
    llm = jinfer.LLM(directory, max_seq_len=256)
    ids = _ids(2, 40)
    ref_logp = torch.log_softmax(torch.tensor(_reference_logits(model, ids)), dim=-1).numpy()
    ref_scores = np.take_along_axis(ref_logp[0, :-1], ids[0, 1:, None], axis=-1)[:, 0]
    (ours,) = llm.score([ids[0].tolist()])
    assert ours.dtype == np.float32 and ours.shape == (ids.shape[1] - 1,)
    assert np.abs(ours - ref_scores).max() <= 1e-4 * np.ptp(ref_logp)

    prompt = ids[:, :12]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor(prompt), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, prompt.shape[1] :].tolist()
    (completion,) = llm.generate(
        [prompt[0].tolist()], jinfer.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    )
    assert completion.token_ids == ref
    assert completion.finish_reason == "length"
