"""The embedded SmolLM2-135M-Instruct GGUF against transformers loading the same file."""

import os

import numpy as np
import pytest
import torch

import jinfer

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little"
TEXTS = [
    "Once upon a time, there was a little girl named Emma.",
    "  Leading spaces,\ttabs\nand\n\nnewlines   ",
    "Héllo wörld — ça va? Grüße, 東京, Привет 🙂🚀 <|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def hf_reference(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model


def test_greedy_continuation_matches_transformers(smollm2_llm, hf_reference):
    tokenizer, model = hf_reference
    ids = smollm2_llm.tokenizer.encode(PROMPT)
    assert ids == tokenizer(PROMPT).input_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids) :].tolist()
    (out,) = smollm2_llm.generate([PROMPT], jinfer.SamplingParams(max_tokens=40, temperature=0))
    assert out.token_ids == ref[: len(out.token_ids)]
    assert len(out.token_ids) >= 32
    assert out.text.startswith(" girl named Emma")


def test_score_matches_transformers(smollm2_llm, hf_reference):
    _, model = hf_reference
    ids = smollm2_llm.tokenizer.encode(TEXTS[0] + " She loved to play in the sun.")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits.float(), dim=-1)[0].numpy()
    ref = np.take_along_axis(logp[:-1], np.array(ids[1:])[:, None], axis=-1)[:, 0]
    (ours,) = smollm2_llm.score([ids])
    assert np.abs(ours - ref).max() <= 1e-4 * np.ptp(logp)


def test_chat_answers_paris(smollm2_llm):
    (out,) = smollm2_llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        jinfer.SamplingParams(max_tokens=40, temperature=0),
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.text


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2_llm, hf_reference, text):
    tokenizer, _ = hf_reference
    ids = smollm2_llm.tokenizer.encode(text)
    assert ids == tokenizer(text).input_ids
    assert smollm2_llm.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gguf_tokenizer_splits_digits_like_llama_cpp(smollm2_llm):
    # tokenizer.ggml.pre = "smollm": llama.cpp isolates every digit (transformers' GGUF import does not).
    tok = smollm2_llm.tokenizer
    ids = tok.encode("in 2024 we had 31337 users")
    digit_pieces = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert digit_pieces == list("2024") + list("31337")


@pytest.mark.parametrize(
    "sampling",
    [
        jinfer.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        jinfer.SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_batch_invariance_on_smollm2(smollm2_llm, sampling):
    (alone,) = smollm2_llm.generate([PROMPT], sampling)
    slots = smollm2_llm.engine.layout.max_slots
    rng = np.random.RandomState(0)
    neighbours = [TEXTS[i % len(TEXTS)] * (1 + i % 3) for i in range(slots - 1)]
    neighbour_sampling = [
        jinfer.SamplingParams(
            max_tokens=int(rng.randint(8, 30)), temperature=float(rng.choice([0, 1.0])), seed=i
        )
        for i in range(slots - 1)
    ]
    for slot in (0, slots // 2, slots - 1):
        prompts = [*neighbours[:slot], PROMPT, *neighbours[slot:]]
        samplings = [*neighbour_sampling[:slot], sampling, *neighbour_sampling[slot:]]
        assert smollm2_llm.generate(prompts, samplings)[slot].token_ids == alone.token_ids, slot


def test_a_peft_adapter_scores_and_decodes_as_transformers_with_peft(smollm2_path, tmp_path):
    """PEFT's LoRA over SmolLM2's float32 weights (the GGUF's, dequantized), in transformers and
    in jinfer: the same log-probs and greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_path)
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    reference = get_peft_model(base, config).eval()
    reference.save_pretrained(tmp_path)
    llm = jinfer.LLM(quantization="none", max_slots=2, max_seq_len=256, max_loras=1, max_lora_rank=8)
    llm.load_adapter("peft", tmp_path)
    ids = llm.tokenizer.encode(TEXTS[0] + " She loved to play in the sun.")
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits.float(), dim=-1)[0].numpy()
        greedy = reference.generate(torch.tensor([ids[:8]]), max_new_tokens=24, do_sample=False)[0, 8:]
    want = np.take_along_axis(logp[:-1], np.array(ids[1:])[:, None], axis=-1)[:, 0]
    (ours,) = llm.score([ids], adapter="peft")
    (base_logp,) = llm.score([ids])
    assert np.abs(base_logp - want).max() > 0.1, "the adapter changes nothing"
    assert np.abs(ours - want).max() <= 1e-4 * np.ptp(logp)
    out = llm.generate([ids[:8]], jinfer.SamplingParams(max_tokens=24, temperature=0), adapter="peft")[0]
    assert out.token_ids == greedy.tolist()[: len(out.token_ids)] and len(out.token_ids) >= 16
