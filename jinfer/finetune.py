"""Fine-tuning through the engine's own forward: a low-rank adapter (`jinfer.lora`), or every
weight, trained with optax on a JSONL of chats or prompt/completion pairs.

    examples = read_examples("train.jsonl", tokenizer, max_length)
    trainer = Trainer(cfg, params, TrainConfig(...), adapter=lora.init_adapter(...))
    trainer.run(examples, held_out, output_dir)      # checkpoints, then the adapter, in output_dir

The loss is the mean negative log-likelihood of the answer tokens only: a chat's assistant
messages (each one's tokens as the chat template writes them, its end-of-turn included), or a
pair's completion (and the end-of-sequence token). Examples of similar length are batched
together and padded at the end to a multiple of 32 tokens (so a handful of shapes compile);
padding is masked out of the loss and, being after every real token, changes no real token's
attention. The train step is one jitted function: the family's `forward_groups` without a cache
over the base weights (float: quantized matrices are dequantized for the trainer, and stay
frozen), the adapter applied as inference applies it, the loss, its gradient with respect to the
trainable tree only, and an optax update: AdamW, linear warm-up then cosine decay, gradient
clipping by global norm, `accumulation` micro-batches per update (optax.MultiSteps).

The batches are a pure function of the seed and the micro-batch index, and a checkpoint (orbax,
every `checkpoint_every` updates) holds the trainable tree, the optimizer's state and the step:
a run resumed from one ends with the same bits as a run never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import jinfer.lora as lora
from jinfer.config import ModelConfig
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.options import setting

log = logging.getLogger("jinfer.finetune")

LENGTH_MULTIPLE = 32  # batches are padded to a multiple of this many tokens
CHECKPOINTS = "checkpoints"


class Example(NamedTuple):
    ids: list[int]
    trained: list[bool]  # per token: whether the loss predicts it (an answer's token)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How a run trains (each field a `jinfer finetune` flag)."""

    steps: int = setting(100, "optimizer updates")
    batch_size: int = setting(8, "examples per micro-batch")
    accumulation: int = setting(1, "micro-batches whose gradients one update averages")
    learning_rate: float = setting(2e-4, "the peak learning rate (AdamW)")
    warmup_steps: int = setting(10, "updates of linear warm-up before the cosine decay to 0")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay")
    max_grad_norm: float = setting(1.0, "gradients are clipped to this global norm")
    max_length: int = setting(1024, "tokens an example keeps (answer tokens past it are not trained)")
    eval_every: int = setting(50, "updates between held-out losses (and one at the end)")
    checkpoint_every: int = setting(50, "updates between checkpoints (and one at the end)")
    log_every: int = setting(10, "updates between progress lines")
    seed: int = setting(0, "orders the batches and initializes the adapter")

    def __post_init__(self):
        for name in ("steps", "batch_size", "accumulation", "max_length", "eval_every", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


# ---------------------------------------------------------------------------------- data
def read_examples(path: str, tokenizer, max_length: int) -> list[Example]:
    """The examples of a JSONL file: each line {"messages": [...]} (a chat; the assistant
    messages are trained) or {"prompt": ..., "completion": ...}. ValueError naming the line for
    one that is neither."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                example = _example(record, tokenizer)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            if not any(example.trained[:max_length]):
                raise ValueError(f"{path}:{number}: no answer token within max_length {max_length}")
            examples.append(Example(example.ids[:max_length], example.trained[:max_length]))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def _example(record: dict, tokenizer) -> Example:
    if "messages" in record:
        return chat_example(record["messages"], tokenizer)
    if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
        raise ValueError('a line is {"messages": [...]} or {"prompt": "...", "completion": "..."}')
    prompt = tokenizer.encode(record["prompt"])
    answer = tokenizer.encode(record["completion"], add_special_tokens=False)
    eos = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    answer += [eos] if eos is not None else []
    return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer))


def chat_example(messages: Sequence[dict[str, Any]], tokenizer) -> Example:
    """A chat's tokens as its template writes them, each assistant message's tokens trained: those
    the template adds from the generation prompt before the message to the end of the message."""
    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
        raise ValueError("messages must be a list that ends with an assistant message")
    ids: list[int] = []
    trained: list[bool] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        asked = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)
        answered = tokenizer.apply_chat_template(
            messages[: i + 1], add_generation_prompt=False, tokenize=True
        )
        if answered[: len(asked)] != asked or asked[: len(ids)] != ids:
            raise ValueError(
                "the chat template's tokens of a prefix of the chat are not a prefix of its tokens"
            )
        trained += [False] * (len(asked) - len(ids)) + [True] * (len(answered) - len(asked))
        ids = answered
    return Example(ids, trained)


def micro_batch(examples: Sequence[Example], batch_size: int, seed: int, index: int):
    """Micro-batch `index` of the endless sequence the seed orders (epoch after epoch, each a new
    order), as `padded` gives it. Examples are grouped by length (within windows of 8 batches)
    so a batch holds little padding; a batch short of examples repeats none: its other rows
    weigh nothing."""
    per_epoch = math.ceil(len(examples) / batch_size)
    epoch, position = divmod(index, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    window = 8 * batch_size
    grouped = np.concatenate(
        [
            sorted(order[i : i + window], key=lambda j: len(examples[j].ids))
            for i in range(0, len(order), window)
        ]
    )
    batches = [grouped[i : i + batch_size] for i in range(0, len(grouped), batch_size)]
    chosen = batches[np.random.default_rng([seed, epoch, 1]).permutation(len(batches))[position]]
    return padded([examples[j] for j in chosen], batch_size)


def padded(examples: Sequence[Example], rows: int):
    """Tokens and trained masks [rows, T] of `examples` (rows past them empty), padded at the end
    to T, the longest rounded up to LENGTH_MULTIPLE; and how many tokens are real."""
    longest = max(len(e.ids) for e in examples)
    length = -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    for row, example in enumerate(examples):
        tokens[row, : len(example.ids)] = example.ids
        mask[row, : len(example.ids)] = example.trained
    return tokens, mask, sum(len(e.ids) for e in examples)


# ---------------------------------------------------------------------------------- steps
def token_logprobs(params, tokens, *, cfg: ModelConfig, vocab: int):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) [B, T-1]: the family's forward without a cache."""
    family = family_of(cfg)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    (hidden,), _ = family.forward_groups(params, (TokenGroup(tokens, positions),), cfg)
    logp = jax.nn.log_softmax(family.logits(params, hidden[:, :-1])[..., :vocab], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def token_losses(params, tokens, mask, *, cfg: ModelConfig, vocab: int):
    """(summed negative log-likelihood of the trained tokens, how many there are) of a batch."""
    nll = -token_logprobs(params, tokens, cfg=cfg, vocab=vocab)
    weights = mask[:, 1:]
    return (nll * weights).sum(), weights.sum()


def with_adapter(cfg: ModelConfig) -> Callable:
    """(adapter, base params) -> the params a forward with that adapter reads."""
    return lambda adapter, base: lora.adapted(base, cfg, lora.single(adapter, cfg))


def every_weight(trainable, _base):
    return trainable


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array  # [] int32: optimizer updates made
    trainable: Any
    optimizer: Any


def optimizer(config: TrainConfig):
    """AdamW after clipping by global norm, the rate warmed up linearly then decayed by a cosine to
    0 over the run, applied once every `accumulation` micro-batches."""
    import optax

    warmup = min(config.warmup_steps, config.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, config.steps, 0.0)
    inner = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )
    return optax.MultiSteps(inner, every_k_schedule=config.accumulation)


def _train_step(state: TrainState, base, tokens, mask, *, update, apply, cfg, vocab):
    """One micro-batch: the loss, its gradient with respect to the trainable tree, and the
    optimizer's (accumulating) update. Returns the state, the batch's mean loss and token count."""
    import optax

    def mean_loss(trainable):
        total, count = token_losses(apply(trainable, base), tokens, mask, cfg=cfg, vocab=vocab)
        return total / jnp.maximum(count, 1.0), count

    (loss, count), grads = jax.value_and_grad(mean_loss, has_aux=True)(state.trainable)
    updates, opt_state = update(grads, state.optimizer, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    return TrainState(state.step + 1, trainable, opt_state), loss, count


class Trainer:
    """Trains `trainable` (an `Adapter`, or the params themselves with `apply=every_weight`) over
    frozen float `base` params (see the module docstring). `history` holds a record per logged
    update: its number, the mean loss since the last record, tokens/s, and the held-out loss
    where one was computed."""

    def __init__(self, cfg: ModelConfig, base, config: TrainConfig, trainable, vocab: int, apply=None):
        from functools import partial

        self.cfg, self.base, self.config, self.vocab = cfg, base, config, vocab
        self.optimizer = optimizer(config)
        self.state = TrainState(jnp.int32(0), trainable, self.optimizer.init(trainable))
        apply = apply or with_adapter(cfg)
        options = {"cfg": cfg, "vocab": vocab}
        step = partial(_train_step, update=self.optimizer.update, apply=apply, **options)
        self._step = jax.jit(step, donate_argnums=0)
        losses = lambda trainable, base, tokens, mask: token_losses(
            apply(trainable, base), tokens, mask, **options
        )
        self._losses = jax.jit(losses)
        self.history: list[dict[str, float]] = []

    @property
    def trainable(self):
        return self.state.trainable

    def held_out_loss(self, examples: Sequence[Example]) -> float:
        """The mean loss per trained token over `examples`, in batches in their order."""
        size, total, count = self.config.batch_size, 0.0, 0.0
        for start in range(0, len(examples), size):
            tokens, mask, _ = padded(examples[start : start + size], size)
            batch_total, batch_count = self._losses(self.state.trainable, self.base, tokens, mask)
            total, count = total + float(batch_total), count + float(batch_count)
        return total / max(count, 1.0)

    def run(
        self,
        examples: Sequence[Example],
        held_out: Sequence[Example] = (),
        output_dir: str | None = None,
        until: int | None = None,
        progress: bool = False,
    ):
        """Train up to update `until` (default: `config.steps`; from the last checkpoint in
        output_dir, if any, checkpointing there; without one nothing is written); the trainable
        tree. Called again, it goes on from where it stopped. With `progress`, a bar on stderr
        counts the updates with the last one's loss and tokens/s (each update then waits for its
        loss, which costs the overlap of one batch's host work with the step)."""
        config = self.config
        if output_dir is not None:
            self._restore(output_dir)
        micro, target = int(self.state.step), until or config.steps
        bar = tqdm(total=target, initial=micro // config.accumulation, unit="update", disable=not progress)
        since_log = Tally(time.perf_counter())
        with bar, logging_redirect_tqdm() if progress else contextlib.nullcontext():
            while micro < target * config.accumulation:
                this_update = Tally(time.perf_counter())
                for _ in range(config.accumulation):
                    tokens, mask, real = micro_batch(examples, config.batch_size, config.seed, micro)
                    self.state, loss, _ = self._step(self.state, self.base, tokens, mask)
                    micro += 1
                    this_update.add(loss, real)
                    since_log.add(loss, real)
                update, last = micro // config.accumulation, micro == target * config.accumulation
                if progress:
                    bar.update(1)
                    bar.set_postfix(this_update.described(time.perf_counter()), refresh=False)
                if update % config.log_every == 0 or last:
                    evaluate = update % config.eval_every == 0 or last
                    self._record(update, since_log, held_out if evaluate else ())
                    since_log = Tally(time.perf_counter())
                if output_dir is not None and (update % config.checkpoint_every == 0 or last):
                    self._save(output_dir, update)
        return self.state.trainable

    def _record(self, update: int, tally: Tally, held_out: Sequence[Example]) -> None:
        """A progress record of the updates since the last (`history`, and a log line)."""
        record = {"update": update, **tally.described(time.perf_counter())}
        if held_out:
            record["held_out_loss"] = self.held_out_loss(held_out)
        self.history.append(record)
        log.info("update %d/%d %s", update, self.config.steps, _described(record))

    def _save(self, output_dir: str, update: int) -> None:
        import orbax.checkpoint as ocp

        directory = os.path.abspath(os.path.join(output_dir, CHECKPOINTS))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(directory, str(update)), self.state, force=True)
            checkpointer.wait_until_finished()
        for old in _checkpoints(directory)[:-1]:  # the latest is all a resume needs
            import shutil

            shutil.rmtree(os.path.join(directory, str(old)))

    def _restore(self, output_dir: str) -> None:
        import orbax.checkpoint as ocp

        directory = os.path.abspath(os.path.join(output_dir, CHECKPOINTS))
        found = _checkpoints(directory)
        if not found:
            return
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.state)
        with ocp.StandardCheckpointer() as checkpointer:
            self.state = checkpointer.restore(os.path.join(directory, str(found[-1])), target)
        log.info("resumed from update %d", found[-1])


@dataclasses.dataclass
class Tally:
    """Micro-batches' losses (on the device until described) and real tokens since `start`."""

    start: float
    losses: list = dataclasses.field(default_factory=list)
    tokens: float = 0.0

    def add(self, loss: jax.Array, tokens: float) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def described(self, now: float) -> dict[str, float]:
        """Their mean loss and tokens/s (waits for the losses)."""
        loss = float(np.mean(jax.device_get(self.losses)))
        return {"loss": loss, "tokens_per_s": self.tokens / (now - self.start)}


def _checkpoints(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _described(record: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "update")


def finetune(
    model: str | None,
    train_path: str,
    output_dir: str,
    *,
    held_out_path: str | None = None,
    config: TrainConfig | None = None,
    adapter: lora.LoraConfig | None = None,
    full: bool = False,
    progress: bool = False,
) -> list[dict[str, float]]:
    """Train an adapter (`adapter`'s config; default LoraConfig()) or, with `full`, every weight of
    `model` (default: the embedded SmolLM2) on a JSONL file, resuming from output_dir's last
    checkpoint if there is one; write the result there: the adapter (jinfer's format, which
    `LLM.load_adapter` and `jinfer serve --lora` read), or a jinfer checkpoint of the model.
    Returns the progress records (`Trainer.history`); `progress`: a bar on stderr (`Trainer.run`)."""
    from jinfer.formats.adapters import save_adapter
    from jinfer.formats.checkpoint import save_checkpoint
    from jinfer.loading import default_model_path, load_model

    config = config or TrainConfig()
    loaded = load_model(model or default_model_path(), quantization="none")  # the trainer's float copy
    cfg, tokenizer = loaded.config, loaded.tokenizer
    examples = read_examples(train_path, tokenizer, config.max_length)
    held_out = read_examples(held_out_path, tokenizer, config.max_length) if held_out_path else []
    log.info("%d examples (%d held out); %s", len(examples), len(held_out), config)
    if full:
        trainer = Trainer(cfg, None, config, loaded.params, cfg.vocab_size, apply=every_weight)
    else:
        initial = lora.init_adapter(cfg, adapter or lora.LoraConfig(), jax.random.key(config.seed))
        trainer = Trainer(cfg, loaded.params, config, initial, cfg.vocab_size)
    trained = trainer.run(examples, held_out, output_dir, progress=progress)
    if full:
        save_checkpoint(output_dir, dataclasses.replace(loaded, params=trained))
    else:
        save_adapter(output_dir, trained, cfg)
    return trainer.history
