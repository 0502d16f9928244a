"""Loading every checkpoint format into the same parameters: safetensors, GGUF, orbax."""

import copy
import json
import os
import shutil
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny import VOCAB, write_gguf

import jinfer
from jinfer.config import EngineConfig
from jinfer.formats.checkpoint import CHECKPOINT_MARKER, load_checkpoint, save_checkpoint
from jinfer.formats.gguf import load_gguf
from jinfer.formats.hf import load_hf
from jinfer.formats.params import param_paths
from jinfer.loading import CheckpointError, load_model, placement_for
from jinfer.models import llama, quantized
from jinfer.sharding import MODEL, make_mesh, param_shardings, place_params


def _flat(params) -> dict[str, np.ndarray]:
    from jinfer.formats.params import path_name

    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {path_name(p): np.asarray(v, dtype=np.float32) for p, v in flat}


def _logits(loaded, ids):
    """The model's logits for `ids`, as one compiled program (op by op, every op compiles alone)."""

    @jax.jit
    def forward(params, ids):
        hidden, _ = llama.forward(params, ids, jnp.arange(ids.shape[1])[None], loaded.config)
        return llama.logits(params, hidden)

    return np.asarray(forward(loaded.params, ids))


IDS = np.random.RandomState(5).randint(0, VOCAB, (1, 30))


def test_sharded_safetensors_with_index_equals_single_file(tiny_model, tmp_path):
    directory, model = tiny_model("llama_gqa_untied")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    single, sharded = _flat(load_hf(directory).params), _flat(load_hf(str(tmp_path)).params)
    assert single.keys() == sharded.keys()
    for name in single:
        np.testing.assert_array_equal(single[name], sharded[name])


def test_bfloat16_safetensors_load(tiny_model, tmp_path):
    directory, model = tiny_model("qwen2_bias_tied")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)  # the shared model stays float32
    reference = _flat(load_hf(directory).params)
    for name, value in _flat(load_hf(str(tmp_path)).params).items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_dequantize_to_the_original_weights(tiny_model, tmp_path, qtype):
    directory, model = tiny_model("llama_gqa_untied")
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_gguf(model, directory, path, qtype)
    from_gguf, from_hf = load_gguf(path, quantization="none"), load_hf(directory)
    assert from_gguf.config.rope == from_hf.config.rope
    ours, reference = _flat(from_gguf.params), _flat(from_hf.params)
    # Kept as blocks (Q8_0, Q4_0, Q4_1), the same values.
    for name, value in _flat(quantized.dequantized(load_gguf(path).params)).items():
        np.testing.assert_array_equal(value, ours[name])
    assert ours.keys() == reference.keys()
    # Worst-case relative error of each format on weights ~N(0, 0.1).
    tolerance = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q4_0": 0.2, "Q4_1": 0.1}[qtype]
    for name, value in ours.items():
        scale = np.abs(reference[name]).max()
        assert np.abs(value - reference[name]).max() <= tolerance * scale + 1e-7, name
    if qtype == "F32":  # unpermuted Q/K exactly: the whole model computes the same logits
        np.testing.assert_array_equal(_logits(from_gguf, IDS), _logits(from_hf, IDS))
    # The tokenizer stored in the GGUF encodes exactly like the tokenizer.json it came from.
    text = "Once upon a time, ça va? 🙂"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_load_through_gguf_dequantize(tmp_path, qtype):
    """K-quant blocks (256 values) of random content load as gguf's own reference dequantization."""
    kind = gguf.GGMLQuantizationType[qtype]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.RandomState(0)
    rows, cols = 64, 256
    raw = rng.randint(0, 256, (rows, cols // block_values * block_bytes)).astype(np.uint8)
    # Keep the fp16 scale fields finite and small: d (and dmin) sit at the start of Q4_K/Q5_K
    # blocks and at the end of Q6_K blocks.
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    offsets = [block_bytes - 2] if qtype == "Q6_K" else [0, 2]
    for offset in offsets:
        blocks[:, :, offset : offset + 2] = scale
    path = str(tmp_path / "k.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_gate.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from jinfer.formats.gguf import dequantize as _dequantize
    from jinfer.formats.gguf import read_gguf

    (tensor,) = read_gguf(path).tensors
    ours = _dequantize(tensor)
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, kind))
    assert np.isfinite(ours).all() and np.ptp(ours) > 0


def test_orbax_round_trip_restores_into_sharding(tiny_model, tmp_path):
    directory, _ = tiny_model("llama_gqa_untied")
    loaded = load_hf(directory)
    save_checkpoint(str(tmp_path / "ckpt"), loaded)
    mesh = make_mesh(data=2, model=4)
    shardings = param_shardings(loaded.config, mesh, {"vocab": MODEL, "mlp": MODEL})
    restored = load_checkpoint(str(tmp_path / "ckpt"), shardings=shardings)
    assert restored.config == loaded.config
    assert restored.params.embed.sharding == shardings.embed
    assert len(restored.params.layers[0].w_gate_up.addressable_shards) == 8
    original = _flat(loaded.params)
    for name, value in _flat(restored.params).items():
        np.testing.assert_array_equal(value, original[name])
    text = "What is the capital of France?"
    assert restored.tokenizer.encode(text) == loaded.tokenizer.encode(text)
    assert restored.tokenizer.chat_template == loaded.tokenizer.chat_template


def _set_checkpoint_version(directory, version) -> None:
    marker = os.path.join(directory, CHECKPOINT_MARKER)
    with open(marker, encoding="utf-8") as f:
        meta = json.load(f)
    meta["version"] = version
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(meta, f)


def test_checkpoint_format_versions_are_checked(tiny_model, tmp_path):
    directory, _ = tiny_model("llama_gqa_untied")
    loaded = load_hf(directory)
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, loaded)
    _set_checkpoint_version(ckpt, 1)  # version 1 in today's layout still restores
    _flat(load_checkpoint(ckpt).params)
    _set_checkpoint_version(ckpt, 99)
    with pytest.raises(CheckpointError, match=r"format version 99.*jinfer convert"):
        load_checkpoint(ckpt)
    # Version 1 params that do not fit today's layout (stand-in: another model's params) fail
    # with the advice to convert again.
    other = load_hf(tiny_model("qwen3_qknorm")[0])
    save_checkpoint(str(tmp_path / "other"), other)
    shutil.rmtree(os.path.join(ckpt, "params"))
    shutil.copytree(str(tmp_path / "other" / "params"), os.path.join(ckpt, "params"))
    _set_checkpoint_version(ckpt, 1)
    with pytest.raises(CheckpointError, match=r"cannot restore params.*version 1.*jinfer convert"):
        load_checkpoint(ckpt)


def test_convert_cli_writes_a_checkpoint_jinfer_serves_identically(tiny_model, tmp_path):
    directory, _ = tiny_model("qwen3_qknorm")
    dst = str(tmp_path / "converted")
    run = subprocess.run(
        [sys.executable, "-m", "jinfer.cli", "convert", directory, dst],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    original, converted = jinfer.LLM(directory), jinfer.LLM(dst)
    sampling = jinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "Once upon a time"
    assert (
        converted.generate([prompt], sampling)[0].token_ids
        == original.generate([prompt], sampling)[0].token_ids
    )
    np.testing.assert_array_equal(converted.score([prompt])[0], original.score([prompt])[0])


def test_param_paths_cover_every_declared_weight(tiny_model):
    directory, _ = tiny_model("qwen2_bias_tied")
    loaded = load_model(directory)
    paths = param_paths(loaded.config)
    assert "lm_head" not in paths and "layers.1.bqkv" in paths and "layers.0.q_norm" not in paths
    assert set(_flat(loaded.params)) == set(paths)


def _same_placed(direct, whole, placement) -> None:
    """Weights loaded onto their shards = the whole tree loaded, then placed: sharding, dtype, values."""
    _, expected = place_params(whole.config, whole.params, placement.mesh, placement.dtype)
    for got, want in zip(jax.tree.leaves(direct.params), jax.tree.leaves(expected), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(("data", "model", "dtype"), [(2, 4, "float32"), (1, 8, "bfloat16")])
def test_a_mesh_loads_each_weight_straight_onto_its_shards(tiny_model, data, model, dtype):
    directory, _ = tiny_model("smollm2_like")  # 6 query / 2 kv heads: padded for the model axis
    placement = placement_for(EngineConfig(mesh_data=data, mesh_model=model, dtype=dtype))
    _same_placed(load_model(directory, placement=placement), load_model(directory), placement)


def test_a_gguf_loads_dequantized_onto_its_shards(tiny_model, tmp_path):
    directory, model = tiny_model("llama_gqa_untied")
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(model, directory, path, "Q4_1")
    placement = placement_for(EngineConfig(mesh_model=4))
    direct = load_gguf(path, placement=placement)
    _same_placed(direct, load_gguf(path, quantization="none"), placement)
    assert not quantized.formats_held(direct.params)


def test_a_checkpoint_restores_straight_onto_a_meshs_shards(tiny_model, tmp_path):
    directory, _ = tiny_model("llama_gqa_untied")  # 4 query / 2 kv heads: divides model 2 as it is
    save_checkpoint(str(tmp_path / "ckpt"), load_hf(directory))
    placement = placement_for(EngineConfig(mesh_data=2, mesh_model=2, dtype="bfloat16"))
    assert placement.fits(load_hf(directory).config)
    _same_placed(load_model(str(tmp_path / "ckpt"), placement=placement), load_hf(directory), placement)
