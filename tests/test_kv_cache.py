"""Prefill into the KV cache followed by cached decode steps equals one full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import VOCAB

from jinfer.formats.hf import load_hf
from jinfer.kernels import cpu_attention, gpu_attention
from jinfer.kv_cache import init_cache
from jinfer.models import attention, llama


@pytest.mark.parametrize("kernel", [None, "cpu"], ids=["einsum", "cpu-kernel"])
@pytest.mark.parametrize("family", ["mistral_sliding", "qwen3_qknorm", "llama3_rope_tied"])
def test_prefill_then_decode_equals_full_forward(family, kernel, tiny_model):
    directory, _ = tiny_model(family)
    loaded = load_hf(directory)
    params, cfg = loaded.params, loaded.config
    total, prompt_len, padded = 40, 11, 16
    ids = np.random.RandomState(3).randint(0, VOCAB, (2, total)).astype(np.int32)

    hidden, _ = llama.forward(params, ids, np.broadcast_to(np.arange(total), (2, total)), cfg)
    full = np.asarray(llama.logits(params, hidden))  # [2, total, V]

    # Prefill a prompt padded past its length (as buckets do), then decode one token at a time.
    cache = init_cache(cfg, batch=2, max_len=64)
    tokens = np.zeros((2, padded), np.int32)
    tokens[:, :prompt_len] = ids[:, :prompt_len]
    hidden, cache = llama.forward(params, tokens, np.broadcast_to(np.arange(padded), (2, padded)), cfg, cache)
    step_logits = [np.asarray(llama.logits(params, hidden[:, prompt_len - 1]))]
    if kernel:
        assert cpu_attention.available()

    def decode_step(p, tokens, positions, cache):
        group = llama.TokenGroup(tokens, positions)
        (hidden,), cache = llama.forward_groups(p, (group,), cfg, cache, attention_kernel=kernel)
        return hidden, cache

    decode = jax.jit(decode_step, donate_argnums=3)
    for pos in range(prompt_len, total):
        hidden, cache = decode(params, ids[:, pos : pos + 1], jnp.full((2, 1), pos, jnp.int32), cache)
        step_logits.append(np.asarray(llama.logits(params, hidden[:, 0])))
    cached = np.stack(step_logits, axis=1)  # logits after positions prompt_len-1 .. total-1
    reference = full[:, prompt_len - 1 :]
    assert np.abs(cached - reference).max() <= 1e-4 * np.ptp(reference)


def test_random_init_follows_the_declaration(tiny_model):
    from jinfer.models.llama import init_params, is_spec, param_specs

    cfg = load_hf(tiny_model("qwen2_bias_tied")[0]).config
    params = init_params(cfg, jax.random.key(0))
    specs, _ = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    leaves, _ = jax.tree.flatten(params)
    assert [leaf.shape for leaf in leaves] == [spec.shape for spec in specs]
    for spec, leaf in zip(specs, leaves, strict=True):
        expected = {"ones": 1.0, "zeros": 0.0}.get(spec.init)
        if expected is not None:
            assert np.all(np.asarray(leaf) == expected)
        else:
            assert 0.015 < float(jnp.std(leaf)) < 0.025  # normal * 0.02
    hidden, _ = llama.forward(params, np.zeros((1, 4), np.int32), np.arange(4)[None], cfg)
    assert np.isfinite(np.asarray(llama.logits(params, hidden))).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 40], ids=["causal", "sliding"])
def test_decode_attention_kernel_equals_xla_attention(window, dtype):
    """The Pallas kernel (real on a GPU, interpreted on a CPU) against the einsum attention."""
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and dtype == jnp.float32:
        pytest.skip("the engine uses the kernel only for 16-bit caches on a GPU (float32 would be TF32)")
    slots, rows, kv_heads, groups, length, head_dim = 6, 5, 2, 3, 2048, 64
    assert gpu_attention.fits(length)
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(rows, kv_heads, groups, 1, head_dim), dtype)
    cache_k, cache_v = (jnp.asarray(rng.randn(slots, kv_heads, length, head_dim), dtype) for _ in range(2))
    # Row 2 is idle (position -1: no keys); row 5 is not decoded.
    positions = np.array([0, 17, -1, 300, length - 1], np.int32)
    got = gpu_attention.attention(q, cache_k, cache_v, positions, window, interpret=not on_gpu)
    assert got.dtype == dtype
    got = np.asarray(got, np.float32)
    key_positions = np.broadcast_to(np.arange(length), (rows, length))
    want = attention.attention(q, cache_k[:rows], cache_v[:rows], positions[:, None], key_positions, window)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    active = positions >= 0
    assert np.abs(got[active] - np.asarray(want, np.float32)[active]).max() <= tolerance
    assert np.all(got[~active] == 0)  # finite: the engine gives idle rows -1


@pytest.mark.parametrize("window", [0, 300], ids=["causal", "sliding"])
@pytest.mark.parametrize("start", [0, 250, 590], ids=["first-block", "across-blocks", "clamped-last-block"])
def test_filled_attention_equals_attention_over_the_whole_row(start, window):
    """Prompt tokens attend over blocks of their rows up to their own end: the same result as
    attending over every position of the rows (a 600-position row: its last block is clamped)."""
    slots, kv_heads, groups, chunk, length, head_dim = 5, 2, 3, 10, 600, 16
    rng = np.random.RandomState(1)
    rows = np.array([3, 1], np.int32)
    q = jnp.asarray(rng.randn(len(rows), kv_heads, groups, chunk, head_dim), jnp.float32)
    cache_k, cache_v = (
        jnp.asarray(rng.randn(slots, kv_heads, length, head_dim), jnp.float32) for _ in range(2)
    )
    q_pos = np.broadcast_to(np.minimum(start + np.arange(chunk), length - 1), (len(rows), chunk))
    got = attention.filled_attention(q, cache_k, cache_v, rows, q_pos, window)
    key_positions = np.broadcast_to(np.arange(length), (len(rows), length))
    want = attention.attention(q, cache_k[rows], cache_v[rows], q_pos, key_positions, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("batch", "tokens", "head_dim", "length", "window"),
    [
        (4, 1, 64, 1024, 0),  # decoding rows, one split each
        (1, 1, 64, 2048, 0),  # one long row: its keys split over tasks, partial sums merged
        (3, 1, 16, 300, 40),  # sliding window
        (1, 13, 24, 600, 0),  # a prompt chunk in a chosen row, causal within itself
        (2, 7, 64, 400, 50),  # chunks with a window reaching back into earlier blocks
    ],
)
def test_cpu_attention_kernel_equals_xla_attention(batch, tokens, head_dim, length, window):
    """The C++ kernel reads rows `rows` of the cache in place up to each query's position; XLA's
    einsum attention over the gathered rows is the reference. A query at a negative position (an
    inactive slot) sees nothing and gets zeros."""
    assert cpu_attention.available()
    kv_heads, groups, cache_rows = 2, 3, 5
    rng = np.random.RandomState(1)
    q = jnp.asarray(rng.randn(batch, kv_heads, groups, tokens, head_dim), jnp.float32)
    cache_k, cache_v = (
        jnp.asarray(rng.randn(cache_rows, kv_heads, length, head_dim), jnp.float32) for _ in "kv"
    )
    rows = jnp.asarray(rng.permutation(cache_rows)[:batch], jnp.int32)
    starts = np.array([length - tokens, 0, 170, 33][:batch])  # the last and first positions, and between
    positions = starts[:, None] + np.arange(tokens)
    if batch > 1:
        positions[1] = -1  # an inactive row
    got = np.asarray(
        jax.jit(cpu_attention.attention, static_argnums=5)(q, cache_k, cache_v, rows, positions, window)
    )
    key_positions = np.broadcast_to(np.arange(length), (batch, length))
    want = np.asarray(attention.attention(q, cache_k[rows], cache_v[rows], positions, key_positions, window))
    active = positions[:, 0] >= 0
    assert np.abs(got[active] - want[active]).max() <= 2e-6
    assert np.all(got[~active] == 0)


def test_cpu_attention_kernel_that_cannot_be_built_leaves_xla_attention(
    tmp_path, monkeypatch, caplog, tiny_model
):
    """A failing build is a warning that says why, not an error: the engine attends with XLA's
    einsums over attention buckets instead."""
    import logging

    import jinfer

    monkeypatch.setenv("JINFER_CACHE_DIR", str(tmp_path))  # nothing cached: it must build
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="jinfer.kernels.cpu_attention"):
        assert cpu_attention.available.__wrapped__() is False
    assert "CPU attention kernel unavailable" in caplog.text
    assert "non-zero exit status" in caplog.text
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    # (Packed weights off: with CXX failing, their kernel's first build would fail for the process.)
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=2, max_seq_len=256, packed_weights=False)
    assert llm.engine.steps.attention_buckets == (64, 128, 256)
    out = llm.generate(["hello"], jinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
