"""Text <-> token ids behind one interface, chat templates, and streaming detokenization.

Two backends, `tokenizers` and `sentencepiece`; the formats that carry a tokenizer build one
(`jinfer.formats.hf` from tokenizer.json / tokenizer.model, `jinfer.formats.gguf` from a GGUF's
vocabulary) and `jinfer.load_tokenizer` picks the format by path.

Chat templates are rendered by jinja2 in an immutable sandbox. `IncrementalDetokenizer` turns a
growing id list into text deltas that are always whole UTF-8 characters and, concatenated, equal
the full decode; `TextStream` adds stop strings on top (text that could begin one is held back
until it is known not to, a matched one is never returned).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Protocol


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed."""


class Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...


class HFBackend:
    """A `tokenizers.Tokenizer`; its post-processor decides whether BOS is added."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens):
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)


class SentencePieceBackend:
    def __init__(self, sp, add_bos: bool, add_eos: bool):
        self.sp, self.add_bos, self.add_eos = sp, add_bos, add_eos

    def encode(self, text, add_special_tokens):
        ids = self.sp.encode(text)
        if add_special_tokens and self.add_bos and self.sp.bos_id() >= 0:
            ids = [self.sp.bos_id(), *ids]
        if add_special_tokens and self.add_eos and self.sp.eos_id() >= 0:
            ids = [*ids, self.sp.eos_id()]
        return ids

    def decode(self, ids, skip_special_tokens):
        if skip_special_tokens:
            ids = [i for i in ids if not self.sp.is_control(i)]
        return self.sp.decode(ids)

    def token_to_id(self, token):
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    @property
    def vocab_size(self):
        return self.sp.get_piece_size()


class Tokenizer:
    """encode / decode / chat templates, whatever the source format."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        files: dict[str, Any] | None = None,
    ):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None and (eid := backend.token_to_id(eos_token)) is not None and eid not in ids:
            ids.append(eid)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.chat_template = chat_template
        self._files = files or {}  # what `save` writes back out

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def backend(self) -> Backend:
        """The tokenizers or SentencePiece object behind it (for libraries that read a vocabulary)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ):
        """Render a conversation with the model's jinja2 chat template (sandboxed)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass a raw prompt instead")
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        # The template already wrote BOS where the model wants it.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, directory: str) -> None:
        """Write this tokenizer as files `load_tokenizer(directory)` reads back."""
        os.makedirs(directory, exist_ok=True)
        backend = self._backend
        if isinstance(backend, HFBackend):
            backend.tok.save(os.path.join(directory, "tokenizer.json"))
        else:
            with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
                f.write(backend.sp.serialized_model_proto())
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "jinfer_eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
        }
        if isinstance(backend, SentencePieceBackend):
            config["add_bos_token"], config["add_eos_token"] = backend.add_bos, backend.add_eos
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1, ensure_ascii=False)


# ----------------------------------------------------------------------------- chat templates
def render_chat_template(template: str, messages: list[dict[str, Any]], **variables) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template error: {message}")

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, **variables)
    except TemplateError as e:
        raise TokenizerError(f"chat template failed to render: {e}") from None


# ----------------------------------------------------------------------- streaming detokenizer
class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas.

    Decodes only a short window of recent tokens each step (not the whole output), and holds back
    text while the window ends in an incomplete UTF-8 sequence (decoded as U+FFFD), so every delta
    is whole characters. Deltas concatenated (plus `flush()` at the end) equal `decode(all ids)`.
    Decoding the window with a few tokens of left context keeps SentencePiece's word-initial spaces
    and byte-fallback sequences right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        # [prefix_offset, read_offset) is left context already emitted; read_offset.. is pending.
        self.prefix_offset = max(len(self.ids) - 6, 0)
        self.read_offset = len(self.ids)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids) -> str:
        """Append ids and return the newly completed text (possibly empty)."""
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character (or nothing new) so far: wait for more tokens
        # The emitted window becomes left context for the next one.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. a stream that ended on invalid bytes)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]


class TextStream:
    """Token ids in, safe text deltas out: UTF-8-whole, stop strings matched across tokens."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stops: tuple[str, ...], skip_special_tokens=True
    ):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = stops
        self.pending = ""  # decoded but not yet emitted (might begin a stop string)
        self.stopped = False  # a stop string matched: nothing after it is ever emitted
        self.matched: str | None = None  # the stop string that matched

    def add(self, token_id: int) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was matched)."""
        self.pending += self.detok.add([token_id])
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation ends (nothing, after a stop string)."""
        if self.stopped:
            return ""
        self.pending += self.detok.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)  # the earliest, where two match
            text, self.pending, self.stopped = self.pending[:at], "", True
            return text, True
        hold = 0 if final else self._stop_prefix_len()
        cut = len(self.pending) - hold
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best
