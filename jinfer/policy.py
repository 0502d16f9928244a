"""The log-probs a policy-gradient trainer differentiates, with the sampler's bits.

An RL loop samples with the engine, then trains on the log-probs of what it sampled: an
importance weight exp(new - old) is exactly 1 at the policy that sampled only if the trainer's
log-probs are the sampler's bits. `PolicyLogprobs(engine, base)` gives them as a function of a
LoRA adapter (`jinfer.lora`):

- forward, the engine's own scoring pass (`scoring.next_token_logprobs`: its served weights as
  held, the adapter in a stack of the engine's shape, its attention kernel), so that a token's
  log-prob under the adapter it was sampled with is the sampler's raw log-prob bit for bit where
  `LLM.score` is (see `jinfer.scoring`);
- backward, the gradient of the reference forward (`finetune.token_logprobs` over the float
  weights `base`, the adapter applied to every column): the same function by other arithmetic,
  since a kernel has no gradient of its own. Its cost is one more forward, as rematerialization.

    policy = PolicyLogprobs(llm.engine, llm.params)       # an engine with max_loras >= 1
    logp = policy(adapter, policy.weights, tokens)          # [B, T-1], differentiable in adapter

The weights are an argument, not captured, so that a jitted step takes them as its inputs rather
than as constants compiled into it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jinfer.lora as lora
from jinfer.finetune import token_logprobs, with_adapter
from jinfer.scoring import next_token_logprobs


class PolicyLogprobs:
    """log p(tokens[:, i+1] | tokens[:, :i+1]) [B, T-1] under an adapter (see the module
    docstring); a pure function of (adapter, weights, tokens), for `jax.jit` and `jax.grad`."""

    def __init__(self, engine, base):
        if not engine.adapters.held:
            raise ValueError("the engine holds no adapters: start it with max_loras >= 1")
        self.engine, self.base = engine, base
        steps, layout, slots = engine.steps, engine.layout, engine.adapters
        cfg, vocab = steps.model, steps.vocab_size
        options = {"cfg": cfg, "vocab": vocab, "page_size": layout.page_size}
        options |= {"cache_dtype": engine.device.dtype, "attention_kernel": layout.attention_kernel}

        def exact(adapter: lora.Adapter, served, tokens):
            logp = next_token_logprobs(served, tokens, slots.arranged([adapter]), 0, **options)
            return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

        def reference(adapter: lora.Adapter, base, tokens):
            return token_logprobs(with_adapter(cfg)(adapter, base), tokens, cfg=cfg, vocab=vocab)

        @jax.custom_vjp
        def logprobs(adapter, served, base, tokens):
            return exact(adapter, served, tokens)

        def forward(adapter, served, base, tokens):
            return exact(adapter, served, tokens), (adapter, base, tokens)

        def backward(saved, cotangent):
            adapter, base, tokens = saved
            _, pullback = jax.vjp(functools.partial(reference, base=base, tokens=tokens), adapter)
            return (*pullback(cotangent), None, None, None)

        logprobs.defvjp(forward, backward)
        self._logprobs = logprobs
        self.reference = reference

    @property
    def weights(self) -> tuple:
        """(the engine's served weights as it holds them now, the float base)."""
        return self.engine.device.weights.target, self.base

    def __call__(self, adapter: lora.Adapter, weights: tuple, tokens: jax.Array) -> jax.Array:
        return self._logprobs(adapter, *weights, tokens)
