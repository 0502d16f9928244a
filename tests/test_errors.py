"""Bad input fails with a clear error naming the problem: files, configs, tokenizers, prompts."""

import json
import os
import shutil

import pytest
from tiny import write_gguf

import jinfer
from jinfer.config import UnsupportedModelError
from jinfer.formats.hf import model_config as hf_config
from jinfer.loading import CheckpointError, load_model


def _copy(directory, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(directory, target)
    return target


def _edit_config(target, **changes):
    path = target / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_model_path():
    with pytest.raises(CheckpointError, match="no model at /does/not/exist"):
        jinfer.LLM("/does/not/exist")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="cannot load a model from"):
        load_model(str(tmp_path))


def test_missing_weights_and_pickle_only_weights(tiny_model, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    (target / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        load_model(str(target))
    (target / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    with pytest.raises(CheckpointError, match="never pickle"):
        load_model(str(target))


def test_truncated_safetensors(tiny_model, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(str(target))
    weights.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_model(str(target))


def test_truncated_gguf(tiny_model, tmp_path):
    directory, model = tiny_model("llama_gqa_untied")
    path = tmp_path / "tiny.gguf"
    write_gguf(model, directory, str(path), "Q8_0")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 3, 20):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"truncated|not a readable GGUF"):
            load_model(str(path))


def test_missing_tensor_is_named(tiny_model, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    _edit_config(target, num_hidden_layers=3)  # the weights only hold 2 layers
    with pytest.raises(CheckpointError, match=r"missing tensors for \['layers.2"):
        load_model(str(target))


def test_shape_mismatch_is_named(tiny_model, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    _edit_config(target, intermediate_size=96)
    with pytest.raises(
        CheckpointError, match="w_gate_up has shape \\(2, 128, 64\\), config expects \\(2, 96, 64\\)"
    ):
        load_model(str(target))


def test_unsupported_architecture_config(tiny_model, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    _edit_config(target, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'gpt2'"):
        load_model(str(target))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope scaling type 'dynamic'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_unsupported_options_are_named(tiny_model, changes, message):
    with open(os.path.join(tiny_model("llama_gqa_untied")[0], "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with pytest.raises(UnsupportedModelError, match=message):
        hf_config(config)


def test_tokenizer_that_does_not_match_the_model(tiny_model, smollm2_path, tmp_path):
    target = _copy(tiny_model("llama_gqa_untied")[0], tmp_path)
    (target / "tokenizer.json").unlink()
    jinfer.load_tokenizer(smollm2_path).save(str(target))  # 49152 tokens for a 320-token model
    with pytest.raises(CheckpointError, match="tokenizer has 49152 tokens but the model's vocab_size is 320"):
        load_model(str(target))


def test_bad_prompts_and_sampling(tiny_model):
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_seq_len=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 999]])
    with pytest.raises(
        ValueError, match="context window is 64 tokens, but the prompt has 60 tokens and max_tokens=10"
    ):
        llm.generate([[1] * 60], jinfer.SamplingParams(max_tokens=10))
    with pytest.raises(TypeError, match="not a single string"):
        llm.generate("just one string")
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        jinfer.SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p must be > 0"):
        jinfer.SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="finite"):
        jinfer.SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"max_tokens must be an integer in \[1, 2147483647\]"):
        jinfer.SamplingParams(max_tokens=0)
    # Past what the device's int32 arrays hold: refused before anything runs, on this door too.
    for field, value in (("top_k", 2**31), ("min_tokens", 2**40), ("seed", 2**64), ("temperature", 10**400)):
        with pytest.raises(ValueError, match=field):
            jinfer.SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        llm.generate(["caf\udce9"])
    with pytest.raises(ValueError, match=r"messages\[0\]\.role must be one of"):
        llm.chat([[{"role": "wizard", "content": "hi"}]])
    # The same LLM still works after every rejection.
    (out,) = llm.generate([[1, 2, 3]], jinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_cli_reports_errors_without_traceback(capsys):
    from jinfer.cli import main

    assert main(["generate", "--model", "/does/not/exist", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "error: no model at /does/not/exist" in err and "Traceback" not in err
