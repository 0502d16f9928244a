"""Tiny Hugging Face reference models and tokenizers, built offline for parity tests.

Each family is a transformers model with random weights saved with `save_pretrained` (safetensors)
next to a small byte-level BPE tokenizer trained here on a fixed corpus. `write_gguf` writes the
same weights as a GGUF file the way llama.cpp's converter does (Q/K rows permuted for llama).
"""

from __future__ import annotations

import json
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 320
CORPUS = [
    "Once upon a time, there was a little girl named Emma who loved to play in the sun.",
    "The quick brown fox jumps over the lazy dog. 0123456789 numbers and symbols: #$%&*()!",
    "Héllo wörld — ça va? Grüße aus Köln. 東京は日本の首都です。 Привет, мир! 🙂🚀",
    "def main():\n    print('hello')\n\treturn 42\n",
    "What is the capital of France? The capital of France is Paris.",
]
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (transformers model_type, config overrides). Together they cover GQA, tied and untied
# embeddings, q/k/v biases, q/k norms, sliding windows and each RoPE scaling rule.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama_gqa_untied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama3_rope_tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_linear_rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama_yarn_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral_sliding": ("mistral", {"sliding_window": 8, "num_key_value_heads": 1}),
    "qwen2_bias_tied": ("qwen2", {"tie_word_embeddings": True}),
    # widths of whole 256-input blocks, as GGUF's K-quants need
    "llama_k_quant_widths": ("llama", {"hidden_size": 256, "intermediate_size": 512}),
    "qwen3_qknorm": ("qwen3", {"head_dim": 24, "num_key_value_heads": 2}),
    "smollm2_like": (
        "llama",
        {
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "hidden_size": 96,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        },
    ),
}


def hf_config(family: str):
    from transformers import AutoConfig

    model_type, overrides = FAMILIES[family]
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,  # sharper logits than the default 0.02: greedy ties are unlikely
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def train_tokenizer(directory: str) -> None:
    """A byte-level BPE tokenizer.json with ChatML specials, trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


# A reasoning model's chat template, DeepSeek-R1's way: the assistant's turn opens the thinking,
# or (Qwen3's `enable_thinking: false`) closes an empty block so that the model answers at once.
THINKING_CHATML = CHATML.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}",
)


def build_reasoning_model(directory: str):
    """`qwen3_qknorm`'s random weights with `<think>` / `</think>` in the vocabulary (plain added
    tokens, as Qwen3's) and THINKING_CHATML; returns the transformers model."""
    from tokenizers import AddedToken, Tokenizer

    model = build_hf_model("qwen3_qknorm", directory)
    path = os.path.join(directory, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(path)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": THINKING_CHATML}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return model


def train_sentencepiece(directory: str, extra_texts=()) -> None:
    """A SentencePiece BPE tokenizer.model with byte fallback, trained on CORPUS (+ extra_texts)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 50 + list(extra_texts)),
        model_prefix=os.path.join(directory, "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )


def build_hf_model(family: str, directory: str, seed: int = 0):
    """Save a random transformers model of `family` and a tokenizer into `directory`; return the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager").eval()
    model.save_pretrained(directory)
    train_tokenizer(directory)
    return model


def _gguf_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation for Q and K (the inverse of jinfer's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(model, tokenizer_dir: str, path: str, qtype_name="F32", quantize=None) -> None:
    """Write a llama-architecture transformers model + byte-level tokenizer as a GGUF file.

    Matrices are stored as `qtype_name` (F32, F16, BF16, Q8_0, Q4_0, Q4_1; or a function of the
    tensor's name giving one), quantized by `quantize(w, qtype)` (default: the gguf package's);
    norms stay F32.
    """
    import gguf

    cfg = model.config
    assert cfg.model_type == "llama"
    type_of = qtype_name if callable(qtype_name) else lambda name: qtype_name
    quantize = quantize or gguf.quants.quantize
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    types = [3 if t in specials else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(specials["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads

    def add(name, w):
        w = np.ascontiguousarray(w, dtype=np.float32)
        qtype = gguf.GGMLQuantizationType[type_of(name)]
        if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in _HF_TO_GGUF.items():
            w = state[f"model.layers.{i}.{hf_name}"]
            if gguf_name == "attn_q.weight":
                w = _gguf_permute(w, heads)
            elif gguf_name == "attn_k.weight":
                w = _gguf_permute(w, kv_heads)
            add(f"blk.{i}.{gguf_name}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
