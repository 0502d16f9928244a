"""A token's K/V and logits are the same bits whatever else its forward pass holds: more tokens of
its own row (a speculative verify step's drafts) or other rows (a batch). Batch invariance and the
exactness of speculative decoding rest on it; the kernels are tested for it one by one
(test_cpu_matmul, test_quantized, test_kv_cache), this is the whole model as the engine runs it,
XLA's own parts (norms, rotary embeddings, the cache write) included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import FAMILIES

import jinfer
from jinfer.kv_cache import contiguous_tables
from jinfer.models import llama

SEQ, PAGE = 128, 64


def _engine_forward(llm):
    """One forward pass of rows [rows, tokens] at positions start.. through the engine's weights,
    kernels and a cache of SEQ positions per row: (logits [rows, tokens, V], the cache)."""
    engine = llm.engine
    cfg, kernel = engine.steps.model, engine.layout.attention_kernel

    def run(params, cache, tokens, start):
        rows, length = tokens.shape
        tables = jnp.asarray(contiguous_tables(rows, SEQ, PAGE))
        group = llama.TokenGroup(tokens, start[:, None] + jnp.arange(length)[None])
        (hidden,), cache = llama.forward_groups(params, (group,), cfg, cache, tables, SEQ, kernel)
        return llama.logits(params, hidden), cache

    return jax.jit(run), engine.params, engine.steps


def _prefilled(run, params, steps, prompts):
    cache = steps.new_cache(jnp.float32).target
    rows = len(prompts)
    tables_pages = 1 + rows * (SEQ // PAGE)
    assert steps.layout.num_pages >= tables_pages
    tokens = jnp.asarray(np.stack(prompts))
    _, cache = run(params, cache, tokens, jnp.zeros(rows, jnp.int32))
    return cache


@pytest.mark.parametrize("family", [*FAMILIES, "smollm2-q4_1", "smollm2-float32"])
def test_a_tokens_bits_do_not_depend_on_the_rest_of_its_pass(family, tiny_model):
    if family.startswith("smollm2"):
        llm = jinfer.LLM(max_slots=4, max_seq_len=SEQ, quantization="none" if "float32" in family else "auto")
    else:
        llm = jinfer.LLM(tiny_model(family)[0], max_slots=4, max_seq_len=SEQ)
    run, params, steps = _engine_forward(llm)
    vocab = llm.config.vocab_size
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, min(vocab, 300), 14) for _ in range(4)]
    cache = _prefilled(run, params, steps, prompts)
    copy = lambda c: jax.tree.map(jnp.copy, c)
    nexts = rng.randint(3, min(vocab, 300), (4, 32))
    start = jnp.full(4, 14, jnp.int32)
    # Row 0's token at position 14 alone (one row, one token), then beside others.
    alone_logits, alone_cache = run(params, copy(cache), jnp.asarray(nexts[:1, :1]), start[:1])

    def same_as_alone(logits, cache, what):
        np.testing.assert_array_equal(np.asarray(logits[0, 0]), np.asarray(alone_logits[0, 0]), what)
        for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(alone_cache), strict=True):
            np.testing.assert_array_equal(np.asarray(a[:, 1, 14]), np.asarray(b[:, 1, 14]), what)

    for tokens in (2, 5, 8, 9, 32):
        logits, new = run(params, copy(cache), jnp.asarray(nexts[:1, :tokens]), start[:1])
        same_as_alone(logits, new, f"beside {tokens - 1} more tokens of its row")
    for rows, tokens in ((2, 1), (4, 1), (4, 5), (4, 8)):
        logits, new = run(params, copy(cache), jnp.asarray(nexts[:rows, :tokens]), start[:rows])
        same_as_alone(logits, new, f"in {rows} rows of {tokens} tokens")
