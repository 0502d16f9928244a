"""Quantized weights: the blocks' layout, the CPU kernel against the dequantized values it holds,
and GGUF models (the embedded SmolLM2 Q4_1 among them) served from their quantized tensors."""

import logging
import os
import platform
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import write_gguf

from jinfer import LLM, SamplingParams
from jinfer.config import EngineConfig
from jinfer.engine import Engine
from jinfer.formats.gguf import load_gguf
from jinfer.kernels import cpu_quant_matmul
from jinfer.models import llama, quant_formats, quantized
from jinfer.models.quantized import FORMATS, HostBlocks, QuantizedWeight

GGML = {name: gguf.GGMLQuantizationType[name.upper()] for name in FORMATS}
# Where ggml's blocks keep their float16 scales (and offsets): random bytes there could be NaN.
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}
SCALE_OFFSETS |= {"q5_0": (0,), "q5_1": (0, 2), "q5_k": (0, 2)}
# Every format's float products, and the integer products of the formats that have them (each
# with a layout of its own).
ARITHMETICS = [(f, "float32") for f in sorted(FORMATS)]
ARITHMETICS += [(f, "int8") for f in sorted(quantized.INTEGER_FORMATS)]


def random_blocks(format: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of ggml blocks: random integers (and K-quant sub-block scales), finite random float16
    scales."""
    values, size = gguf.GGML_QUANT_SIZES[GGML[format]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[format]:
        halves = rng.uniform(-0.05, 0.05, (rows, cols // values)).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def width(format: str, groups: int) -> int:
    return groups * FORMATS[format].group


def weight(
    format: str, rows: int, cols: int, seed: int = 0, activations: str = "float32"
) -> tuple[QuantizedWeight, np.ndarray]:
    """A QuantizedWeight (multiplied with `activations`) and gguf's own dequantization of the same
    blocks."""
    raw = random_blocks(format, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, GGML[format]).reshape(rows, cols)
    records = quant_formats.records_from_ggml(FORMATS[format], raw)
    w = QuantizedWeight.from_host(HostBlocks(FORMATS[format], records, (rows, cols)))
    return quantized.with_activations(w, activations), reference


@pytest.mark.parametrize("format, activations", ARITHMETICS)
def test_blocks_hold_exactly_what_ggml_dequantizes_to(format, activations):
    """Regrouped for the kernel (37 rows: a partial block of rows), in the layout of either
    arithmetic, the blocks dequantize to gguf's values, and embedding rows gathered from them too;
    regrouped back, they are the rows of records they were (Q8_0 / Q4_0 / Q4_1: ggml's bytes; the
    others hold their integers and sub-block scales as whole bytes)."""
    cols = width(format, 3)
    w, reference = weight(format, 37, cols, activations=activations)
    records = quant_formats.records_from_ggml(FORMATS[format], random_blocks(format, 37, cols))
    np.testing.assert_array_equal(w.to_host().data, records)
    if FORMATS[format].record_bytes == FORMATS[format].ggml_block_bytes:  # ggml's bytes as they are
        np.testing.assert_array_equal(records, random_blocks(format, 37, cols))
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(w)), reference)
    ids = jnp.array([0, 36, 8, 9, 17])
    np.testing.assert_array_equal(np.asarray(quantized.take_rows(w, ids)), reference[np.asarray(ids)])
    fmt = FORMATS[format]
    assert w.blocks.dtype == jnp.uint8 and w.blocks.shape[1:] == (
        3,
        quantized.block_rows() * fmt.record_bytes,
    )


def integer_parts(format: str, raw: np.ndarray, cols: int):
    """ggml's blocks [rows, ...] -> per row and block of 32 the scale d, the offset m (None
    without one), and the integers as w = d q + m takes them [rows, cols]."""
    fmt = FORMATS[format]
    records = quant_formats.records_from_ggml(fmt, raw).reshape(raw.shape[0], cols // 32, -1)
    halves = lambda at: records[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    d, m = halves(0), halves(2) if format in ("q4_1", "q5_1") else None
    start = 4 if m is not None else 2
    if format in ("q4_0", "q4_1"):
        nibbles = records[..., start:].astype(np.int32)
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1) - (8 if format == "q4_0" else 0)
    else:
        q = records[..., start:].view(np.int8 if fmt.signed else np.uint8).astype(np.int32)
    return d, m, q.reshape(raw.shape[0], cols)


def fma(a, b, c):
    """a b + c rounded once to float32, as a fused multiply-add (the float32 product is exact in
    float64; the sum's second rounding differs only on the rarest ties)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def integer_product(format: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The integer-product formats' arithmetic, the kernel's exactness reference: per column and
    32 inputs, d = max |x| / 127 and q = x / d rounded to nearest even; per block, the exact
    integer sum of w's integers times q, and a row's float sum acc = fma(d_w d, isum, acc), then
    with an offset m, acc = fma(m, d sum(q), acc), block after block."""
    cols, columns = x.shape
    d_w, m_w, w = integer_parts(format, raw, cols)
    blocks = x.T.reshape(columns, cols // 32, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    q = np.rint(blocks / np.where(d > 0, d, 1)[..., None]).astype(np.int64)
    acc = np.zeros((w.shape[0], columns), np.float32)
    for g in range(cols // 32):
        isum = w[:, 32 * g : 32 * g + 32].astype(np.int64) @ q[:, g].T  # [rows, columns]
        acc = fma(d_w[:, g, None] * d[None, :, g], isum.astype(np.float32), acc)
        if m_w is not None:
            d_sum = d[:, g] * q[:, g].sum(axis=-1).astype(np.float32)
            acc = fma(np.broadcast_to(m_w[:, g, None], acc.shape), d_sum[None, :], acc)
    return acc


@pytest.mark.parametrize("format, activations", ARITHMETICS)
@pytest.mark.parametrize("columns", [1, 2, 3, 5, 8, 9, 16, 17, 32, 33])
def test_kernel_products_equal_their_reference(format, activations, columns):
    """Every column count the kernel tiles differently (and past MAX_COLUMNS, in slices) gives:
    with float32 activations, the float64 product of the dequantized matrix to float32 rounding;
    with int8 ones, `integer_product`'s bits, which are the dequantized product but for the
    activations' 8-bit rounding."""
    assert cpu_quant_matmul.available()
    cols = width(format, 2)
    w, reference = weight(format, 45, cols, seed=columns, activations=activations)
    x = np.random.default_rng(columns).standard_normal((cols, columns)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: quantized.project(w, x, (45,)))(x))
    want = reference.astype(np.float64) @ x.astype(np.float64)
    if activations == "int8":
        raw = random_blocks(format, 45, cols, seed=columns)
        np.testing.assert_array_equal(got, integer_product(format, raw, x))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("format, activations", ARITHMETICS)
def test_a_columns_products_do_not_depend_on_its_neighbours(format, activations):
    """Each column's products are the same bits at every column count the kernel takes (1-32):
    batch invariance and speculative decoding's exactness rest on it."""
    cols = width(format, 2)
    w, _ = weight(format, 109, cols, activations=activations)  # whole groups of block rows and a part
    x = np.random.default_rng(0).standard_normal((cols, 32)).astype(np.float32)
    product = jax.jit(lambda x: quantized.project(w, x, (109,)))
    widest = np.asarray(product(x))
    for columns in range(1, 32):
        np.testing.assert_array_equal(np.asarray(product(x[:, :columns])), widest[:, :columns])


def test_rows_stack_and_permute_as_float_rows_do():
    """The loaders' row operations on quantized weights (reshape of the output dims, [None],
    stacking along an output axis) move the same rows as on the float values."""
    _, q_values = weight("q4_1", 2 * 3 * 8, 64, seed=1)
    _, k_values = weight("q4_1", 2 * 1 * 8, 64, seed=2)

    def host(format, rows, seed):
        return HostBlocks(FORMATS[format], random_blocks(format, rows, 64, seed), (rows, 64))

    stacked = quantized.concatenate(
        [host("q4_1", 48, 1).reshape(2, 3, 8, 64), host("q4_1", 16, 2).reshape(2, 1, 8, 64)], axis=1
    )
    assert stacked.shape == (2, 4, 8, 64)
    want = np.concatenate([q_values.reshape(2, 3, 8, 64), k_values.reshape(2, 1, 8, 64)], axis=1)
    got = quantized.dequantize(QuantizedWeight.from_host(stacked))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert host("q8_0", 8, 3)[None].shape == (1, 8, 64)
    # beside a float part (a file may keep one projection unquantized), all stack as floats
    mixed = quantized.concatenate(
        [host("q4_1", 48, 1).reshape(2, 3, 8, 64), k_values.reshape(2, 1, 8, 64)], 1
    )
    np.testing.assert_array_equal(mixed, want)
    with pytest.raises(ValueError):
        quantized.concatenate([stacked, stacked], axis=3)  # the input axis


@pytest.fixture(scope="module")
def tiny_q41(tiny_model, tmp_path_factory):
    directory, model = tiny_model("llama_gqa_untied")
    path = str(tmp_path_factory.mktemp("q41") / "tiny-Q4_1.gguf")
    write_gguf(model, directory, path, "Q4_1")
    return path


def test_gguf_matrices_load_as_their_blocks(tiny_q41, monkeypatch):
    """Q4_1 matrices stay as blocks (no float copy); dequantized they are what the dequantizing
    loader gives; the model's logits through the kernel are the float path's on those values, and
    with int8 activations those of the dequantized values times activations rounded to 8 bits
    (XLA's dot, as `project` multiplies without the kernel)."""
    kept, plain = load_gguf(tiny_q41), load_gguf(tiny_q41, quantization="none")
    layer = kept.params.layers[0]
    assert all(quantized.is_quantized(w) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert quantized.is_quantized(kept.params.lm_head) and quantized.is_quantized(kept.params.embed)
    assert not quantized.is_quantized(layer.attn_norm)
    as_values = quantized.dequantized(kept.params)
    for got, want in zip(jax.tree.leaves(as_values), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ids = np.random.default_rng(3).integers(0, kept.config.vocab_size, (1, 20))
    positions = np.arange(20)[None]

    def logits(params):
        hidden, _ = llama.forward(params, ids, positions, kept.config)
        return np.asarray(llama.logits(params, hidden[:, -3:]))  # few columns: the kernel

    want = logits(plain.params)
    np.testing.assert_allclose(logits(kept.params), want, rtol=0, atol=1e-5 * np.abs(want).max())
    int8 = quantized.with_activations(kept.params, "int8")
    got = logits(int8)
    monkeypatch.setattr(cpu_quant_matmul, "available", lambda: False)
    want = logits(int8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    floats = logits(kept.params)
    assert np.abs(got - floats).max() > 1e-3 * np.abs(floats).max()  # rounded: not the float path


def test_engine_keeps_blocks_unless_asked_not_to(tiny_q41, caplog):
    kept = Engine(load_gguf(tiny_q41), EngineConfig(max_slots=2, max_seq_len=64))
    assert quantized.is_quantized(kept.params.layers[0].w_down)
    with caplog.at_level(logging.INFO, logger="jinfer.loading"):
        plain = Engine(load_gguf(tiny_q41), EngineConfig(max_slots=2, max_seq_len=64, quantization="none"))
    assert not quantized.formats_held(plain.params)
    assert "dequantized to float32: quantization=none" in caplog.text
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


def test_int8_activations_are_an_engine_setting(tiny_q41, caplog):
    """quantized_activations="int8" marks the engine's Q4_1 weights (the start-up log says so);
    new weights from the file take the engine's arithmetic without a compile and answer as before;
    an unknown value is refused."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="jinfer.engine"):
        llm = LLM(tiny_q41, max_slots=2, max_seq_len=64, quantized_activations="int8")
    assert "int8 activations" in caplog.text
    assert quantized.activations_of(llm.engine.params) == "int8"
    before, compiles = llm.generate(["Once upon a time"], greedy)[0].token_ids, llm.engine.compile_count()
    llm.update_weights(load_gguf(tiny_q41).params)  # as loaded: float32 activations
    assert quantized.activations_of(llm.engine.params) == "int8"
    assert llm.generate(["Once upon a time"], greedy)[0].token_ids == before
    assert llm.engine.compile_count() == compiles
    with pytest.raises(ValueError, match="quantized_activations must be one of"):
        EngineConfig(quantized_activations="int4")


@pytest.mark.slow
def test_smollm2_q4_1_greedy_and_memory_match_the_dequantized_model(smollm2_path):
    """The embedded Q4_1 file served from its blocks: greedy continuations identical to the
    dequantized model for 32 tokens, in a crowd too (served as `jinfer serve` does: one decode
    step a dispatch, one prompt piece an iteration, so the crowd's decode rows share forwards with
    the prompts); with int8 activations, identical alone and in a crowd; its weights held within
    1.3x the file's tensor bytes (4.5-8.5 bits a weight, not 32)."""
    from jinfer.formats.gguf import read_gguf

    options = dict(max_slots=4, max_seq_len=256)
    kept = LLM(decode_steps=1, max_num_batched_tokens=64, **options)
    plain = LLM(quantization="none", **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["Once upon a time, there was a little", "The three primary colors are", "def fib(n):"]
    for prompt in prompts:
        want = plain.generate([prompt], greedy)[0].token_ids
        assert kept.generate([prompt], greedy)[0].token_ids == want
    crowd = kept.generate(prompts, greedy)
    assert [c.token_ids for c in crowd] == [c.token_ids for c in plain.generate(prompts, greedy)]
    int8 = LLM(decode_steps=1, max_num_batched_tokens=64, quantized_activations="int8", **options)
    assert quantized.activations_of(int8.engine.params) == "int8"
    alone = [int8.generate([prompt], greedy)[0].token_ids for prompt in prompts]
    assert [c.token_ids for c in int8.generate(prompts, greedy)] == alone
    assert int8.engine.dispatch_counts.mixed_dispatches > 0
    assert kept.engine.dispatch_counts.mixed_dispatches > 0
    file_bytes = sum(t.n_bytes for t in read_gguf(smollm2_path).tensors)
    held = sum(a.nbytes for a in jax.tree.leaves(kept.engine.params))
    assert held <= 1.3 * file_bytes, (held, file_bytes)
    assert quantized.formats_held(kept.engine.params) == {"q4_1": 120, "q8_0": 1}


# A fixed text for perplexity (written for these tests).
TEXT = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty years. He climbed "
    "the spiral stairs, counted the hundred and twelve steps out of habit, and wiped the salt from "
    "the great lens with a soft cloth. Below him the harbour was still dark, but the fishing boats "
    "were already moving, their small lamps swinging over the water like fireflies. He made tea on "
    "the little stove, wrote the weather in his notebook - wind from the north-west, a light swell, "
    "clouds thinning in the east - and watched the first gulls circle the rocks. In the afternoon "
    "the supply boat brought flour, lamp oil and a letter from his daughter, who lived in the city "
    "and worked as an engineer on bridges. She wrote that she would visit in the summer and bring "
    "her two children, who had never seen the sea. He read the letter twice, folded it carefully "
    "and put it in the drawer with the others. Then he went back up the stairs to light the lamp."
)


def perplexity(params, cfg, ids: np.ndarray) -> float:
    tokens = jnp.asarray(ids)[None]
    hidden, _ = llama.forward(params, tokens, jnp.arange(len(ids))[None], cfg)
    logp = jax.nn.log_softmax(llama.logits(params, hidden)[0, :-1], axis=-1)
    return float(np.exp(-np.mean(np.take_along_axis(np.asarray(logp), ids[1:, None], axis=1))))


@pytest.mark.slow
def test_perplexity_int8_and_q4_1_against_float32(smollm2_path):
    """On a fixed text: the Q4_1 file's blocks give the perplexity of its dequantized values; int8
    (per output channel, of those float values) stays within 0.5% of them; with int8 activations
    (llama.cpp's arithmetic) the Q4_1 blocks stay within 2% (0.9% when this test was written)."""
    from jinfer.formats.params import placed
    from jinfer.loading import load_model
    from jinfer.models.params import is_spec, param_specs

    kept, plain = load_model(smollm2_path), load_model(smollm2_path, quantization="none")
    ids = np.asarray(plain.tokenizer.encode(TEXT), np.int32)
    as_int8 = lambda spec, w: placed(np.asarray(w), spec, jnp.float32, "int8")
    int8 = jax.tree.map(as_int8, param_specs(plain.config), plain.params, is_leaf=is_spec)
    assert quantized.formats_held(int8) == {"q8_0": 121}
    float32 = perplexity(plain.params, plain.config, ids)
    assert perplexity(kept.params, kept.config, ids) == pytest.approx(float32, rel=1e-4)
    assert perplexity(int8, plain.config, ids) == pytest.approx(float32, rel=5e-3)
    rounded = quantized.with_activations(kept.params, "int8")
    assert perplexity(rounded, kept.config, ids) == pytest.approx(float32, rel=2e-2)
    assert 1 < float32 < 100  # the model reads the text as text


def test_int8_for_a_float_model_and_its_checkpoint(tiny_model, tmp_path):
    """A Hugging Face model quantized to int8 at load decodes from its blocks; `jinfer convert
    --quantization int8` writes those blocks to a checkpoint that serves the same tokens (on this
    CPU or one with another kernel width: blocks are stored as ggml rows)."""
    directory, _ = tiny_model("llama_gqa_untied")
    llm = LLM(directory, quantization="int8", max_slots=2, max_seq_len=64)
    # every layer matrix and the (untied) output projection; the input embedding is only gathered
    assert quantized.formats_held(llm.engine.params) == {"q8_0": 4 * llm.config.num_layers + 1}
    dst = str(tmp_path / "int8")
    command = [sys.executable, "-m", "jinfer.cli", "convert", directory, dst, "--quantization", "int8"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    restored = LLM(dst, max_slots=2, max_seq_len=64)
    assert quantized.formats_held(restored.engine.params) == quantized.formats_held(llm.engine.params)
    for got, want in zip(
        jax.tree.leaves(restored.engine.params), jax.tree.leaves(llm.engine.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm.generate(["Once upon a time"], greedy)[0].token_ids
    assert restored.generate(["Once upon a time"], greedy)[0].token_ids == want
    plain = LLM(dst, quantization="none", max_slots=2, max_seq_len=64)
    assert not quantized.formats_held(plain.engine.params)


def _in_fresh_process(script: str, env: dict) -> str:
    """Run `script` in a new Python (a process registers one build of each kernel)."""
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(__file__),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


# Builds standing in for other x86 CPUs: 8 rows (no AVX-512) with AVX-VNNI's 256-bit integer dot
# products where this CPU has them, then with AVX2's maddubs alone (a Zen 3); 16 rows with AVX-512's
# maddubs where this CPU has AVX-512 but the flag takes VNNI away (a Skylake-X).
OTHER_BUILDS = {"-mno-avx512f": 8, "-mno-avx512f -mno-avxvnni": 8, "-mno-avx512vnni": None}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="these are x86 flags")
@pytest.mark.parametrize("flags", sorted(OTHER_BUILDS))
def test_builds_for_other_cpus_give_the_same_products(flags):
    rows = OTHER_BUILDS[flags]
    script = (
        "import test_quantized as t; from jinfer.kernels import cpu_quant_matmul as k\n"
        f"assert {rows} is None or k.block_rows() == {rows}, k.block_rows()\n"
        "for f, a in t.ARITHMETICS:\n"
        "    for n in (1, 3, 8, 17): t.test_kernel_products_equal_their_reference(f, a, n)\n"
        "    t.test_a_columns_products_do_not_depend_on_its_neighbours(f, a)\n"
        "    t.test_blocks_hold_exactly_what_ggml_dequantizes_to(f, a)\n"
        "print('checked')"
    )
    assert "checked" in _in_fresh_process(script, {"JINFER_KERNEL_CXXFLAGS": flags})


def test_without_the_kernel_quantized_weights_are_dequantized(tiny_q41, tmp_path):
    """A kernel that cannot be built (no compiler) leaves an engine that dequantizes the blocks at
    load, says why, and generates what the dequantizing loader's engine generates."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from jinfer import LLM, SamplingParams; from jinfer.models import quantized\n"
        f"greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)\n"
        f"llm = LLM({tiny_q41!r}, max_slots=2, max_seq_len=64)\n"
        "assert not quantized.formats_held(llm.engine.params)\n"
        "print('tokens', llm.generate(['Once upon a time'], greedy)[0].token_ids)"
    )
    out = _in_fresh_process(script, {"JINFER_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert "quantized weights dequantized to float32: jinfer multiplies quantized weights on one CPU" in out
    plain = LLM(tiny_q41, quantization="none", max_slots=2, max_seq_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert f"tokens {plain.generate(['Once upon a time'], greedy)[0].token_ids}" in out


def test_loading_quantized_blocks_makes_no_float_copies(smollm2_path):
    """The embedded file loaded as its blocks peaks far below the same file dequantized (538 MB of
    float32): no float copy of a quantized tensor is made on the way."""
    script = (  # VmHWM: this process's peak (ru_maxrss would carry over pytest's across exec)
        "import sys; from jinfer.loading import load_model\n"
        f"loaded = load_model({smollm2_path!r}, quantization=sys.argv[1])\n"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
    )
    peak = {}
    for quantization in ("auto", "none"):
        run = subprocess.run(
            [sys.executable, "-c", script, quantization], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        peak[quantization] = int(run.stdout.split()[-1]) * 1024
    assert peak["none"] - peak["auto"] > 400e6, peak


def test_k_quant_gguf_serves_from_its_blocks(tiny_model, tmp_path):
    """A GGUF mixing K-quants as Q4_K_M files do (values, down projections and the output in
    Q6_K, so the stacked q/k/v holds two formats; here the output projections in Q5_K; random
    blocks, since the gguf package cannot quantize to K-quants) is served from its blocks, which
    hold exactly the dequantizing loader's values, with the same greedy tokens as the model
    dequantized at load; a checkpoint keeps the blocks as they are."""
    from jinfer.formats.checkpoint import load_checkpoint, save_checkpoint

    directory, model = tiny_model("llama_k_quant_widths")
    path = str(tmp_path / "k.gguf")
    q6_k = lambda name: name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight"
    kinds = lambda name: "Q6_K" if q6_k(name) else "Q5_K" if name.endswith("attn_output.weight") else "Q4_K"
    rows_of = lambda w, qtype: random_blocks(qtype.name.lower(), w.shape[0], w.shape[1], seed=w.shape[0])
    write_gguf(model, directory, path, kinds, quantize=rows_of)
    kept, plain = load_gguf(path), load_gguf(path, quantization="none")
    layers = kept.config.num_layers
    want = {"q4_k": 3 * layers + 1, "q5_k": layers, "q6_k": 2 * layers + 1}
    assert quantized.formats_held(kept.params) == want
    assert isinstance(kept.params.layers[0].wqkv, quantized.StackedWeight)
    save_checkpoint(str(tmp_path / "ckpt"), kept)
    restored = load_checkpoint(str(tmp_path / "ckpt"))
    for loaded in (kept, restored):
        as_values = quantized.dequantized(loaded.params)
        for got, want in zip(jax.tree.leaves(as_values), jax.tree.leaves(plain.params), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy_tokens(quantization: str) -> list[int]:
        llm = LLM(path, quantization=quantization, max_slots=2, max_seq_len=64)
        return llm.generate(["Once upon a time"], greedy)[0].token_ids

    assert greedy_tokens("auto") == greedy_tokens("none")
