"""A model family defined outside jinfer, for tests: Llama with one different block, a GELU (tanh)
gated MLP where Llama has SiLU (Hugging Face: a llama config.json with
hidden_act="gelu_pytorch_tanh"), under its own model_type. Importing this module registers it
(`jinfer.models.family`); a server finds it through JINFER_FAMILIES=toy_family.

`build(directory)` writes such a model (random weights, the tiny tokenizer) and returns the
transformers model that computes the same function, as the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax

from jinfer.config import UnsupportedModelError
from jinfer.models import llama, llama_checkpoints
from jinfer.models.family import register
from jinfer.models.linear import project

MODEL_TYPE = "jinfer_toy"
ACTIVATION = "gelu_pytorch_tanh"


def gelu_mlp(p, x):
    """GELU-gated MLP over columns x [D, N] (Llama's weights, another activation)."""
    gate, up = project(p.w_gate_up, x)
    return project(p.w_down, jax.nn.gelu(gate, approximate=True) * up)


def hf_config(hf):
    if hf.get("hidden_act") != ACTIVATION:
        raise UnsupportedModelError(f"{MODEL_TYPE} needs hidden_act {ACTIVATION!r}")
    cfg = llama_checkpoints.hf_config({**hf, "model_type": "llama", "hidden_act": "silu"})
    return dataclasses.replace(cfg, architecture=MODEL_TYPE)


FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="toy",
    forward_groups=functools.partial(llama.forward_groups, mlp=gelu_mlp),
    hf_config=hf_config,
    gguf_config=None,
    gguf_tensor=None,
)
register(FAMILY, [MODEL_TYPE])


def build(directory: str):
    """A random toy model in `directory` (config.json naming MODEL_TYPE, safetensors, tokenizer);
    returns the transformers Llama with the same weights and activation (the reference)."""
    import tiny
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny.hf_config("llama_gqa_untied")
    config.hidden_act = ACTIVATION
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(directory)
    tiny.train_tokenizer(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        written = json.load(f)
    written.update(model_type=MODEL_TYPE, architectures=["JinferToyForCausalLM"])
    with open(path, "w") as f:
        json.dump(written, f)
    return model
