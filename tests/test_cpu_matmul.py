"""The CPU few-column matmul kernel against XLA's product, and the engine with packed weights."""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.kernels import cpu_matmul

# Rows not a multiple of the block (zero padding cut off), odd widths, every column count of one
# pass (1-16, with two blocks up to 12), and two passes (19); prompts' widths (33 on: packed
# panels, tasks over groups of blocks and spans of columns, a short last pass), one with a group
# of blocks left over (1000 rows) and one with many groups (3000).
CASES = [(64, 64, 1), (61, 37, 2), (128, 96, 3), (200, 64, 4), (8, 5, 5), (1000, 129, 7), (64, 64, 8)]
CASES += [(200, 70, 12), (33, 40, 13), (77, 50, 16), (77, 50, 19)]
CASES += [(200, 70, 33), (1000, 129, 100), (3000, 576, 256), (61, 1536, 65)]


def _assert_packed_product_matches(rows, width, columns):
    rng = np.random.default_rng(rows * columns)
    w = rng.standard_normal((rows, width), dtype=np.float32)
    x = rng.standard_normal((width, columns), dtype=np.float32)
    packed = cpu_matmul.pack(jnp.asarray(w))
    block = cpu_matmul.block_rows()
    assert packed.shape == (-(-rows // block), width, block)
    got = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(packed, jnp.asarray(x), rows))
    want = w.astype(np.float64) @ x.astype(np.float64)
    assert got.shape == (rows, columns)
    assert np.abs(got - want).max() <= 1e-5 * np.sqrt(width) * np.abs(want).max()


def _assert_columns_independent(rows=300, width=70):
    """Each column's products are the same bits whatever the column count: 1-32 (every tiling of
    a decode step) and prompts' widths (packed panels, spans of columns)."""
    rng = np.random.default_rng(5)
    packed = cpu_matmul.pack(jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32)))
    x = rng.standard_normal((width, 200), dtype=np.float32)
    product = jax.jit(cpu_matmul.matmul, static_argnums=2)
    widest = np.asarray(product(packed, jnp.asarray(x), rows))
    for columns in [*range(1, 34), 47, 64, 130, 199]:
        np.testing.assert_array_equal(
            np.asarray(product(packed, jnp.asarray(x[:, :columns]), rows)), widest[:, :columns]
        )


def test_a_columns_products_do_not_depend_on_its_neighbours():
    """Batch invariance and speculative decoding's exactness rest on this: a slot's token, and a
    verify step's k + 1 positions, must be what it alone would get."""
    _assert_columns_independent()


@pytest.mark.parametrize("rows, width, columns", CASES)
def test_packed_product_equals_xla_product(rows, width, columns):
    assert cpu_matmul.available()
    assert cpu_matmul.block_rows() in (8, 16)  # one vector register of floats: AVX-512 or 8 lanes
    _assert_packed_product_matches(rows, width, columns)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx512f is an x86 compiler flag")
def test_the_8_row_build_for_cpus_without_avx512_gives_the_same_products():
    """Where this CPU has AVX-512 the kernel packs 16 rows; built without it (as on CPUs lacking it),
    8. A fresh process, since a process registers one build."""
    script = (
        "import test_cpu_matmul as t; from jinfer.kernels import cpu_matmul as k; "
        "assert k.block_rows() == 8, k.block_rows(); "
        "[t._assert_packed_product_matches(*case) for case in t.CASES]; t._assert_columns_independent(); "
        "print('checked', len(t.CASES))"
    )
    env = dict(os.environ, JINFER_KERNEL_CXXFLAGS="-mno-avx512f")
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and f"checked {len(CASES)}" in run.stdout, run.stderr[-3000:]


def test_a_layout_the_kernel_was_not_built_for_is_a_clear_error():
    assert cpu_matmul.available()
    block = cpu_matmul.block_rows()
    wrong = jnp.zeros((2, 16, block + 8), jnp.float32)
    with pytest.raises(Exception, match=rf"packed \[B, K, {block}\]"):
        jax.block_until_ready(cpu_matmul.matmul(wrong, jnp.ones((16, 2), jnp.float32), 2 * (block + 8)))


def test_a_matmul_kernel_that_cannot_be_built_leaves_xla_products(tmp_path, monkeypatch, caplog, tiny_model):
    """A failing build is a warning that says why: an engine asked for packed weights keeps its
    plain weights and multiplies with XLA's dot, and its config says so."""
    import logging

    import jinfer
    from jinfer.models import llama

    with monkeypatch.context() as scope:  # (the other kernels, built later, see the real compiler)
        scope.setenv("JINFER_CACHE_DIR", str(tmp_path))  # nothing cached: it must build
        scope.setenv("CXX", "false")  # a compiler that always fails
        with caplog.at_level(logging.WARNING, logger="jinfer.kernels.cpu_matmul"):
            assert cpu_matmul._library.__wrapped__() is None
    assert "CPU matmul kernel unavailable" in caplog.text and "non-zero exit status" in caplog.text
    monkeypatch.setattr(cpu_matmul, "available", lambda: False)
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=2, max_seq_len=128, packed_weights=True)
    assert not any(isinstance(w, llama.PackedWeight) for w in vars(llm.engine.params.layers[0]).values())
    assert llm.engine.layout.packed_weights is False and llm.engine.config.packed_weights is True
    out = llm.generate(["hello"], jinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
