"""The draft model of speculative decoding (`speculative="draft"`): a smaller model of the
target's vocabulary whose greedy continuation is what a verify step checks (`jinfer.speculative`).

It keeps a KV cache of its own beside the target's: pages of the same size and numbering, read
through the same block tables, so whatever the host does with pages (the prefix cache, preemption,
clearing a page before reuse) holds for both caches at once. The steps carry its weights and cache
beside the target's (`jinfer.weights`: `Weights.draft`, `Caches.draft`), and every pass of
the target over tokens (`run_model`: prompt chunks, decode steps) is the draft's over the same
tokens too, so the draft's cache holds every position the target's does (except where a batch is
too large for verifying to pay: there plain steps skip the draft and its requests stop drafting,
`Speculation.feeds_draft`). A verify step then drafts k tokens a row (`model_drafts`): one-token
passes, each feeding the token the pass before chose (its argmax, after the row's logit bias), and
one more that only writes the last draft's K/V.

A draft token is a point mass, so the verify step's rule keeps greedy and seeded outputs exactly
those of decoding without a draft, whatever the draft model computes: it only decides how many
tokens a verify step emits.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

import jinfer.lora as lora
from jinfer.config import EngineConfig, ModelConfig
from jinfer.formats.params import CheckpointError, LoadedModel
from jinfer.loading import engine_weights, load_model, placement_for
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.weights import Caches, Weights

log = logging.getLogger("jinfer.draft")

# Text whose tokens must come out the same from the target's and the draft's tokenizer: letters,
# digits, punctuation, code, whitespace runs and multi-byte characters.
VOCABULARY_PROBE = 'The quick brown fox, 1234 times!\n\tdef f(x):\n        return {"ünï": x ** 2}  # 東京 🙂'


def run_model(
    weights: Weights,
    groups,
    cfg: ModelConfig,
    caches: Caches,
    tables,
    *,
    adapters=None,
    draft_cfg=None,
    **attention,
):
    """The target's pass over token groups (its family's `forward_groups`): hidden states per group
    and the caches; with `draft_cfg`, the draft model's pass over the same tokens writes their K/V
    into its own cache (its hidden states are not used). Without it, a draft model's cache is left
    as it is (`Speculation.feeds_draft`). `adapters`: per group, each row's slot in the target's
    adapter stack [b] (`jinfer.lora`; the draft model has none: it only proposes tokens)."""
    target_params = weights.target
    if weights.adapters is not None and adapters is not None:
        slots = [jnp.repeat(rows, g.tokens.shape[1]) for rows, g in zip(adapters, groups, strict=True)]
        target_params = lora.adapted(target_params, cfg, weights.adapters, jnp.concatenate(slots))
    target_pass = family_of(cfg).forward_groups
    hidden, target = target_pass(target_params, groups, cfg, caches.target, tables, **attention)
    if draft_cfg is None:
        return hidden, caches.replace(target=target)
    draft_pass = family_of(draft_cfg).forward_groups
    _, draft = draft_pass(weights.draft, groups, draft_cfg, caches.draft, tables, **attention)
    return hidden, Caches(target, draft)


def model_drafts(weights, caches, state, tables, active, k: int, *, draft_cfg, vocab: int, **attention):
    """The draft model's greedy continuation of each row, k tokens [rows, k] (all real where the
    row is active), and the caches with the draft's K/V written at the row's position .. position
    + k: k one-token passes, then one more that only writes the k-th draft's K/V (were every draft
    accepted, the target goes on from there; its hidden state unused, XLA drops its lm_head)."""
    rows, family = active.shape[0], family_of(draft_cfg)

    def draft_pass(draft_cache, token, offset):
        group = TokenGroup.of_rows(token[:, None], state.positions + offset, active)
        (hidden,), draft_cache = family.forward_groups(
            weights.draft, (group,), draft_cfg, draft_cache, tables, **attention
        )
        return hidden[:, 0], draft_cache

    def drafting_pass(carry, offset):
        draft_cache, token = carry
        hidden, draft_cache = draft_pass(draft_cache, token, offset)
        logits = family.logits(weights.draft, hidden)[:, :vocab] + state.bias
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (draft_cache, token), token

    offsets = jnp.arange(k, dtype=jnp.int32)
    (draft_cache, last), chosen = jax.lax.scan(drafting_pass, (caches.draft, state.tokens), offsets)
    _, draft_cache = draft_pass(draft_cache, last, k)
    drafts = chosen.T  # [rows, k]
    return drafts, jnp.broadcast_to(active[:, None], (rows, k)), caches.replace(draft=draft_cache)


def draft_weights(config: EngineConfig, target: LoadedModel, mesh, dtype):
    """The draft model `config.draft_model` as the engine runs it (`loading.engine_weights`: its
    padded config and its weights), held as `config.draft_quantization` asks, once it is checked to
    share the target's vocabulary (a CheckpointError otherwise); (None, None) without one."""
    if config.draft_model is None:
        return None, None
    held = dataclasses.replace(config, quantization=config.draft_quantization)
    draft = load_model(config.draft_model, quantization=held.quantization, placement=placement_for(config))
    check_shared_vocabulary(target, draft)
    log.info("draft model: %s, %d layers", draft.source, draft.config.num_layers)
    return engine_weights(draft, held, mesh, dtype)


def check_shared_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft proposes token ids: they must mean the target's tokens. The draft's logits must
    cover the target's vocabulary, and where both have tokenizers, those must be of one size and
    split `VOCABULARY_PROBE` into the same ids."""
    if draft.config.vocab_size < target.config.vocab_size:
        raise CheckpointError(
            f"the draft model {draft.source} has {draft.config.vocab_size} vocabulary entries, fewer "
            f"than the {target.config.vocab_size} of {target.source}: a draft model must share the "
            "target's vocabulary"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        return
    sizes = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
    probes = target.tokenizer.encode(VOCABULARY_PROBE, False), draft.tokenizer.encode(VOCABULARY_PROBE, False)
    why = (
        f"tokenizers of {sizes[1]} and {sizes[0]} tokens"
        if sizes[0] != sizes[1]
        else "its tokenizer splits text into other ids"
        if probes[0] != probes[1]
        else None
    )
    if why:
        raise CheckpointError(
            f"the draft model {draft.source} does not share the vocabulary of {target.source} ({why}): "
            "a draft model must share the target's tokenizer"
        )
