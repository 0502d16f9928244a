"""The paged KV cache: prefill into pages followed by cached decode steps equals one full forward
pass, and every attention backend reading pages (XLA's gather, the C++ kernel, the Pallas kernel
interpreted on a CPU) equals XLA's attention over the same keys laid out contiguously."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import VOCAB

from jinfer.formats.hf import load_hf
from jinfer.kernels import cpu_attention, gpu_attention
from jinfer.kv_cache import gather_pages, init_cache, write_kv
from jinfer.models import attention, llama


def _scattered_tables(rows: int, pages: int, pool_pages: int, seed: int = 0) -> np.ndarray:
    """Block tables giving each row `pages` distinct pages of the pool, in shuffled order (page 0,
    the sink, never)."""
    chosen = 1 + np.random.RandomState(seed).permutation(pool_pages - 1)[: rows * pages]
    return chosen.reshape(rows, pages).astype(np.int32)


def _paged(contiguous: np.ndarray, tables: np.ndarray, pool_pages: int, page_size: int) -> np.ndarray:
    """Rows [B, K, S, H] laid out in a pool [K, P, page_size, H] through tables [B, S / page_size]
    (the other pages hold noise that must never be read)."""
    batch, heads, seq, head_dim = contiguous.shape
    pool = np.random.RandomState(9).randn(heads, pool_pages, page_size, head_dim).astype(contiguous.dtype)
    pool[:, tables] = contiguous.reshape(batch, heads, seq // page_size, page_size, head_dim).transpose(
        1, 0, 2, 3, 4
    )
    return pool


@pytest.mark.parametrize("kernel", [None, "cpu"], ids=["einsum", "cpu-kernel"])
@pytest.mark.parametrize("family", ["mistral_sliding", "qwen3_qknorm", "llama3_rope_tied"])
def test_prefill_then_decode_equals_full_forward(family, kernel, tiny_model):
    directory, _ = tiny_model(family)
    loaded = load_hf(directory)
    params, cfg = loaded.params, loaded.config
    total, prompt_len, padded, page_size = 40, 11, 16, 8
    ids = np.random.RandomState(3).randint(0, VOCAB, (2, total)).astype(np.int32)

    hidden, _ = llama.forward(params, ids, np.broadcast_to(np.arange(total), (2, total)), cfg)
    full = np.asarray(llama.logits(params, hidden))  # [2, total, V]

    # Prefill a prompt padded past its length (as buckets do), then decode one token at a time,
    # each row's positions in shuffled pages of one pool.
    pool_pages = 20
    tables = _scattered_tables(2, 64 // page_size, pool_pages)
    cache = init_cache(cfg, pool_pages, page_size)
    tokens = np.zeros((2, padded), np.int32)
    tokens[:, :prompt_len] = ids[:, :prompt_len]
    positions = np.broadcast_to(np.arange(padded), (2, padded))
    hidden, cache = llama.forward(params, tokens, positions, cfg, cache, tables)
    step_logits = [np.asarray(llama.logits(params, hidden[:, prompt_len - 1]))]
    if kernel:
        assert cpu_attention.available()

    def decode_step(p, tokens, positions, cache):
        group = llama.TokenGroup(tokens, positions)
        (hidden,), cache = llama.forward_groups(p, (group,), cfg, cache, tables, attention_kernel=kernel)
        return hidden, cache

    decode = jax.jit(decode_step, donate_argnums=3)
    for pos in range(prompt_len, total):
        hidden, cache = decode(params, ids[:, pos : pos + 1], jnp.full((2, 1), pos, jnp.int32), cache)
        step_logits.append(np.asarray(llama.logits(params, hidden[:, 0])))
    cached = np.stack(step_logits, axis=1)  # logits after positions prompt_len-1 .. total-1
    reference = full[:, prompt_len - 1 :]
    assert np.abs(cached - reference).max() <= 1e-4 * np.ptp(reference)


def test_writes_land_in_their_pages_and_dropped_ones_nowhere():
    """Each position's K/V goes to its page and offset; invalid entries (chunk padding, inactive
    rows), positions past the table and positions it maps to the sink (page 0) change nothing."""
    heads, pool_pages, page_size, head_dim = 2, 9, 4, 8
    tables = np.array([[3, 7, 1], [5, 2, 0]], np.int32)
    positions = np.array([[2, 3, 4, 5, 12], [0, 1, 2, 3, 9]], np.int32)  # 12: past the 3-page table
    valid = np.array([[True] * 5, [True, True, False, False, True]])
    new = np.arange(2 * heads * 5 * head_dim, dtype=np.float32).reshape(2, heads, 5, head_dim) + 1
    zeros = jnp.zeros((heads, pool_pages, page_size, head_dim))
    got, _ = write_kv((zeros, zeros), new, new, positions, tables, valid)
    want = np.zeros(zeros.shape, np.float32)
    for b in range(2):
        for t in range(5):
            p = positions[b, t]
            if valid[b, t] and p < 12 and tables[b, p // page_size] != 0:
                want[:, tables[b, p // page_size], p % page_size] = new[b, :, t]
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.all(want[:, 0] == 0) and np.all(want[:, [4, 6, 8]] == 0)


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
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_attention_kernel_equals_xla_attention(page_size, dtype):
    """The Pallas paged kernel (real on a GPU, interpreted on a CPU) against the einsum attention
    over the same keys laid out contiguously."""
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and dtype == jnp.float32:
        pytest.skip("the engine uses the kernel only for 16-bit caches on a GPU (float32 would be TF32)")
    rows, kv_heads, groups, length, head_dim = 5, 2, 3, 1024, 64
    pages = length // page_size
    assert gpu_attention.fits(pages)
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(rows, kv_heads, groups, 1, head_dim), dtype)
    rows_k, rows_v = (rng.randn(rows, kv_heads, length, head_dim).astype(np.float32) for _ in "kv")
    pool_pages = rows * pages + 3
    tables = _scattered_tables(rows, pages, pool_pages)
    pool_k, pool_v = (jnp.asarray(_paged(r, tables, pool_pages, page_size), dtype) for r in (rows_k, rows_v))
    positions = np.array([0, 17, -1, 300, length - 1], np.int32)  # row 2 idle: no keys
    got = gpu_attention.attention(q, pool_k, pool_v, tables, positions, interpret=not on_gpu)
    assert got.dtype == dtype
    got = np.asarray(got, np.float32)
    key_positions = np.broadcast_to(np.arange(length), (rows, length))
    as_dtype = lambda a: jnp.asarray(a, dtype)
    want = attention.attention(q, as_dtype(rows_k), as_dtype(rows_v), positions[:, None], key_positions, 0)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    active = positions >= 0
    assert np.abs(got[active] - np.asarray(want, np.float32)[active]).max() <= tolerance
    assert np.all(np.isfinite(got[~active]))


@pytest.mark.parametrize("window", [0, 300], ids=["causal", "sliding"])
@pytest.mark.parametrize("start", [0, 250, 590], ids=["first-block", "across-blocks", "clamped-last-block"])
@pytest.mark.parametrize("page_size", [8, 512])
def test_filled_attention_over_pages_equals_attention_over_the_whole_row(start, window, page_size):
    """Prompt tokens attend over blocks of their pages up to their own end: the same result as
    attending over every position of the rows laid out contiguously (a 1024-position table: with
    small pages its last block is clamped; a page larger than a block makes the block a page)."""
    kv_heads, groups, chunk, length, head_dim = 2, 3, 10, 1024, 16
    rng = np.random.RandomState(1)
    q = jnp.asarray(rng.randn(2, kv_heads, groups, chunk, head_dim), jnp.float32)
    rows_k, rows_v = (rng.randn(2, kv_heads, length, head_dim).astype(np.float32) for _ in "kv")
    pool_pages = 2 * length // page_size + 2
    tables = _scattered_tables(2, length // page_size, pool_pages)
    pool_k, pool_v = (jnp.asarray(_paged(r, tables, pool_pages, page_size)) for r in (rows_k, rows_v))
    q_pos = np.broadcast_to(np.minimum(start + np.arange(chunk), length - 1), (2, chunk))
    got = attention.filled_attention(q, pool_k, pool_v, tables, q_pos, window)
    key_positions = np.broadcast_to(np.arange(length), (2, length))
    want = attention.attention(q, rows_k, rows_v, q_pos, key_positions, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(gather_pages(pool_k, tables)), rows_k)


@pytest.mark.parametrize(
    ("batch", "tokens", "head_dim", "length", "window", "page_size"),
    [
        (4, 1, 64, 1024, 0, 16),  # decoding rows, one split each
        (1, 1, 64, 2048, 0, 128),  # one long row: its keys split over tasks, partial sums merged
        (3, 1, 16, 304, 40, 8),  # sliding window; pages smaller than the kernel's blocks
        (1, 13, 24, 608, 0, 32),  # a prompt chunk, causal within itself
        (2, 7, 64, 400, 50, 16),  # chunks with a window reaching back into earlier blocks
    ],
)
def test_cpu_attention_kernel_equals_xla_attention(batch, tokens, head_dim, length, window, page_size):
    """The C++ kernel reads each row's pages in place up to each query's position; XLA's einsum
    attention over the rows laid out contiguously is the reference. A query at a negative position
    (an inactive slot) sees nothing and gets zeros."""
    assert cpu_attention.available()
    kv_heads, groups = 2, 3
    rng = np.random.RandomState(1)
    q = jnp.asarray(rng.randn(batch, kv_heads, groups, tokens, head_dim), jnp.float32)
    rows_k, rows_v = (rng.randn(batch, kv_heads, length, head_dim).astype(np.float32) for _ in "kv")
    pages = length // page_size
    pool_pages = batch * pages + 5
    tables = _scattered_tables(batch, pages, pool_pages, seed=batch)
    pool_k, pool_v = (jnp.asarray(_paged(r, tables, pool_pages, page_size)) for r in (rows_k, rows_v))
    starts = np.array([length - tokens, 0, 170, 33][:batch])  # the last and first positions, and between
    positions = starts[:, None] + np.arange(tokens)
    if batch > 1:
        positions[1] = -1  # an inactive row
    got = np.asarray(
        jax.jit(cpu_attention.attention, static_argnums=5)(q, pool_k, pool_v, tables, positions, window)
    )
    key_positions = np.broadcast_to(np.arange(length), (batch, length))
    want = np.asarray(attention.attention(q, rows_k, rows_v, positions, key_positions, window))
    active = positions[:, 0] >= 0
    assert np.abs(got[active] - want[active]).max() <= 2e-6
    assert np.all(got[~active] == 0)


@pytest.mark.parametrize(
    ("page_size", "window", "groups"), [(16, 0, 3), (48, 0, 3), (64, 0, 4), (16, 100, 3), (64, 300, 4)]
)
def test_cpu_attention_query_does_not_depend_on_the_others_in_the_call(page_size, window, groups):
    """A query's output is the same bits alone as beside other queries of its row (a speculative
    verify step's positions, a prompt piece's tokens: the kernel takes the heads of several tokens
    through a block together) and other rows of other lengths (a batch): batch invariance and
    speculative decoding's exactness rest on it. Rows reach past several key splits."""
    assert cpu_attention.available()
    rng = np.random.RandomState(0)
    kv_heads, head_dim, tokens = 2, 64, 5
    max_pages = 1200 // page_size + 1
    pool_pages = 1 + 4 * max_pages
    pools = [jnp.asarray(rng.randn(kv_heads, pool_pages, page_size, head_dim), jnp.float32) for _ in "kv"]
    tables = _scattered_tables(4, max_pages, pool_pages, seed=3)
    q = rng.randn(4, kv_heads, groups, tokens, head_dim).astype(np.float32)
    positions = np.array([1000, 7, 300, 255])[:, None] + np.arange(tokens)
    call = jax.jit(cpu_attention.attention, static_argnums=5)
    together = np.asarray(call(q, *pools, tables, positions, window))
    for b in range(4):
        for t in range(tokens):
            alone = call(
                q[b : b + 1, :, :, t : t + 1],
                *pools,
                tables[b : b + 1],
                positions[b : b + 1, t : t + 1],
                window,
            )
            np.testing.assert_array_equal(np.asarray(alone)[0, :, :, 0], together[b, :, :, t])


@pytest.mark.parametrize(("page_size", "window", "tokens"), [(64, 0, 1), (16, 0, 3), (32, 200, 1)])
def test_cpu_attention_rows_sharing_a_prefix_give_the_bits_they_give_alone(page_size, window, tokens):
    """Rows whose first pages are the same (a cached prefix) go through those keys together, the
    kernel reading each block once for all of them: each row's output is still the same bits as
    alone, and XLA's attention over its keys agrees. More rows than go through a range together, at
    positions inside the prefix, past it, and in different key splits."""
    assert cpu_attention.available()
    rng = np.random.RandomState(2)
    rows, kv_heads, groups, head_dim = 20, 2, 3, 64
    prefix_pages, own_pages = 640 // page_size, 256 // page_size
    max_pages = prefix_pages + own_pages
    pool_pages = 1 + prefix_pages + rows * own_pages
    pools = [rng.randn(kv_heads, pool_pages, page_size, head_dim).astype(np.float32) for _ in "kv"]
    tables = np.zeros((rows, max_pages), np.int32)
    tables[:, :prefix_pages] = 1 + np.arange(prefix_pages)
    tables[:, prefix_pages:] = 1 + prefix_pages + np.arange(rows * own_pages).reshape(rows, own_pages)
    q = rng.randn(rows, kv_heads, groups, tokens, head_dim).astype(np.float32)
    ends = np.where(np.arange(rows) % 5 == 4, 300, 700 + 7 * np.arange(rows))  # some inside the prefix
    positions = ends[:, None] - tokens + 1 + np.arange(tokens)
    call = jax.jit(cpu_attention.attention, static_argnums=5)
    together = np.asarray(call(q, *map(jnp.asarray, pools), tables, positions, window))
    for b in range(rows):
        alone = call(q[b : b + 1], *map(jnp.asarray, pools), tables[b : b + 1], positions[b : b + 1], window)
        np.testing.assert_array_equal(np.asarray(alone)[0], together[b])
    rows_k, rows_v = (
        np.stack([pool[:, tables[b]].reshape(kv_heads, -1, head_dim) for b in range(rows)]) for pool in pools
    )
    key_positions = np.broadcast_to(np.arange(max_pages * page_size), (rows, max_pages * page_size))
    want = np.asarray(attention.attention(q, rows_k, rows_v, positions, key_positions, window))
    assert np.abs(together - want).max() <= 2e-6


def test_cpu_attention_kernel_that_cannot_be_built_leaves_xla_attention(
    tmp_path, monkeypatch, caplog, tiny_model
):
    """A failing build is a warning that says why, not an error: the engine attends with XLA's
    einsums over attention buckets instead."""
    import logging

    import jinfer

    with monkeypatch.context() as scope:  # (the other kernels, built later, see the real compiler)
        scope.setenv("JINFER_CACHE_DIR", str(tmp_path))  # nothing cached: it must build
        scope.setenv("CXX", "false")  # a compiler that always fails
        with caplog.at_level(logging.WARNING, logger="jinfer.kernels.cpu_attention"):
            assert cpu_attention.available.__wrapped__() is False
    assert "CPU attention kernel unavailable" in caplog.text
    assert "non-zero exit status" in caplog.text
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=2, max_seq_len=256)
    assert llm.engine.steps.attention_buckets == (64, 128, 256)
    out = llm.generate(["hello"], jinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
