"""Text <-> token ids behind one interface, chat templates, and streaming detokenization.

Sources, all ending in a `Tokenizer`:
  * a Hugging Face `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`) -> `tokenizers`
  * a SentencePiece `tokenizer.model` -> `sentencepiece`
  * the vocabulary inside a GGUF file -> a `tokenizers` object jinfer builds itself: byte-level BPE
    (`tokenizer.ggml.model == "gpt2"`, pre-tokenizer chosen by `tokenizer.ggml.pre`) or
    SentencePiece-style BPE with byte fallback (`"llama"`).

Chat templates are rendered by jinja2 in an immutable sandbox. `IncrementalDetokenizer` turns a
growing id list into text deltas that are always whole UTF-8 characters and, concatenated, equal
the full decode.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from jinfer.config import UnsupportedModelError


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed."""


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...


class _HFBackend:
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


class _SentencePieceBackend:
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
        backend: _Backend,
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
        if isinstance(backend, _HFBackend):
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
        if isinstance(backend, _SentencePieceBackend):
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


# ------------------------------------------------------------------------------ loading
def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory (tokenizer.json or tokenizer.model) or a .gguf file."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jinfer.weights import gguf_metadata, read_gguf

        reader = read_gguf(path)
        return tokenizer_from_gguf(reader, gguf_metadata(reader))
    if not os.path.isdir(path):
        raise TokenizerError(f"no tokenizer at {path}: expected a directory or a .gguf file")
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    template = _chat_template(path, config)
    bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
    extra_eos = tuple(config.get("jinfer_eos_token_ids", ()))
    tokenizer_json = os.path.join(path, "tokenizer.json")
    sp_model = os.path.join(path, "tokenizer.model")
    if os.path.exists(tokenizer_json):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{tokenizer_json} is not a valid tokenizer.json: {e}") from None
        backend: _Backend = _HFBackend(tok)
    elif os.path.exists(sp_model):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.load(sp_model)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{sp_model} is not a valid SentencePiece model: {e}") from None
        backend = _SentencePieceBackend(
            sp, config.get("add_bos_token", True), config.get("add_eos_token", False)
        )
        bos = bos or sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else bos
        eos = eos or sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else eos
    else:
        raise TokenizerError(f"no tokenizer.json or tokenizer.model in {path}")
    return Tokenizer(backend, bos_token=bos, eos_token=eos, eos_token_ids=extra_eos, chat_template=template)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(directory: str, config: dict[str, Any]) -> str | None:
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


# -------------------------------------------------------------------------------- GGUF vocab
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str):
    """The pre-tokenizer llama.cpp uses for a GGUF's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact", "codeshell"):  # each digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise UnsupportedModelError(f"unsupported GGUF tokenizer pre-tokenizer {pre!r}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gguf_array(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def tokenizer_from_gguf(reader, meta: dict[str, Any]) -> Tokenizer:
    """Build a `tokenizers` tokenizer from the vocabulary stored in a GGUF file."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = _gguf_array(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise TokenizerError("GGUF file has no tokenizer.ggml.tokens vocabulary")
    types = _gguf_array(reader, "tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    types = np.asarray(types)
    if kind == "gpt2":
        tok = _gguf_byte_level_bpe(reader, meta, tokens)
        default_add_bos = False
    elif kind == "llama":
        tok = _gguf_sentencepiece_bpe(reader, meta, tokens, types)
        default_add_bos = True
    else:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model {kind!r} (jinfer reads 'gpt2' and 'llama')"
        )

    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.nonzero((types == _TOKEN_CONTROL) | (types == _TOKEN_USER_DEFINED))[0]
    ]
    tok.add_special_tokens(special)

    def token_at(key):
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", default_add_bos) and bos is not None:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    eos_ids = tuple(
        int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    )
    return Tokenizer(
        _HFBackend(tok),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _gguf_byte_level_bpe(reader, meta, tokens):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    merges = _gguf_array(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_sentencepiece_bpe(reader, meta, tokens, types):
    """SentencePiece-style BPE: merges ranked by the merged piece's score, bytes as <0xXX> tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    scores = _gguf_array(reader, "tokenizer.ggml.scores")
    scores = np.zeros(len(tokens)) if scores is None else np.asarray(scores, dtype=np.float64)
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: i for t, i in vocab.items() if types[i] in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED)}
    merges = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(
        models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    norm = [normalizers.Replace(" ", "▁")]
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
        dec.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(dec)
    return tok


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
