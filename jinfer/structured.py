"""Constrained decoding: a request's output held to a JSON schema, a regular expression or a grammar.

The host's half. `Grammars` (one per engine, built on its tokenizer) turns a request's constraint
(`SamplingParams.json_schema` / `regex` / `grammar`) into a compiled llguidance matcher once per
distinct constraint (cached; compilation bounded by llguidance's parser limits), so a bad one is a
`RequestError` while the request is prepared, before anything reaches the device. Each request
then gets its own `Constraint`, a copy of the compiled matcher that the scheduler feeds every
committed token and that writes the request's row of the allowed-token bitmask before each
dispatch that samples for it:

    allowed [slots, ceil(V / 32)] int32, bit t % 32 of word t // 32 = token t may come next
    (-1, every bit set, for a row without a constraint)

The device applies that bitmask when it samples (`jinfer.steps`); since the next mask depends on
the token just sampled, a constrained request takes one token per dispatch, and the engine reads
its token back before it plans the next (`jinfer.engine`). A constraint that is complete ends the
request with "stop" without waiting for the model's end-of-sequence token; one cut by max_tokens
ends with "length", never presented as complete. A reasoning model's constraint holds its answer
only: `ThinkingFirst` allows every token until the thinking's closing marker (`jinfer.reasoning`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from typing import Any

import llguidance as llg
import numpy as np

from jinfer.sampling import RequestError, SamplingParams
from jinfer.tokenizer import HFBackend, Tokenizer

ALL_ALLOWED = -1  # a bitmask word with every token allowed
CACHED_GRAMMARS = 256  # compiled constraints kept (least recently used dropped)
# The largest constraint taken, as text: llguidance's limits bound its work on one, but an inline
# schema whose anyOf branches nest (not $ref) grows exponentially inside it before its own size
# check (measured: 20 levels 10.7 s, 30 out of memory), and such a schema's text doubles with
# every level too, so a bound on the text bounds the work (1 MiB admits 13 levels: 0.31 s, refused).
MAX_CONSTRAINT_BYTES = 2**20


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask."""
    return -(-vocab_size // 32)


def allowed_bitmask(requests, slots: int, vocab_size: int) -> np.ndarray | None:
    """The allowed-token bitmask [slots, W] of a dispatch that samples these requests' (or None's)
    next tokens: each constrained one's allowed set in its slot's row, every bit set in the others;
    None when none is constrained. A fresh array each time (see `Steps.put_allowed`)."""
    constrained = [r for r in requests if r is not None and r.constraint is not None]
    if not constrained:
        return None
    allowed = np.full((slots, mask_words(vocab_size)), ALL_ALLOWED, np.int32)
    for request in constrained:
        request.constraint.fill(allowed[request.slot])
    return allowed


def _parser_limits():
    """llguidance's work limits, which bound how long compiling (and each mask) can take: its
    defaults, stated here so that they are a decision of ours."""
    return llg.LLParserLimits(
        initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis at compile time
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,  # errors go back to the client: no parser state in them
    )


def _llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
    """The tokenizer as llguidance sees it: every id's bytes, the end-of-sequence ids."""
    eos = list(eos_token_ids) or None
    backend = tokenizer.backend
    if isinstance(backend, HFBackend):
        return llg.LLTokenizer(backend.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    return llg.LLTokenizer(_SentencePieceTokens(backend.sp, eos), n_vocab=vocab_size, eos_token=eos)


class _SentencePieceTokens:
    """A SentencePiece model in the shape llguidance's TokenizerWrapper reads: each piece's bytes
    (U+2581 is a space, <0xNN> pieces their byte, control pieces nothing) and an encode call.

    llguidance encodes the text a grammar forces into tokens; SentencePiece's own encode would add
    its dummy-prefix space in front, so this encodes by longest match over the pieces' bytes
    (byte pieces cover the rest)."""

    is_tokenizer_wrapper = True

    def __init__(self, sp, eos):
        self.sp = sp
        self.eos_token_id = eos[0] if eos else sp.eos_id()
        self.bos_token_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.tokens = [self._bytes(i) for i in range(sp.get_piece_size())]
        self.special_token_ids = [i for i in range(sp.get_piece_size()) if sp.is_control(i)]
        self._ids = {}
        for i, piece in enumerate(self.tokens):
            if piece and (piece not in self._ids or sp.is_byte(self._ids[piece])):
                self._ids[piece] = i  # a whole piece rather than its byte piece
        self._longest = max(map(len, self._ids))

    def _bytes(self, i: int) -> bytes:
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):
            return bytes([int(piece[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids, at = [], 0
        while at < len(data):
            for length in range(min(self._longest, len(data) - at), 0, -1):
                if (token := self._ids.get(data[at : at + length])) is not None:
                    ids.append(token)
                    at += length
                    break
            else:  # a byte no piece covers (a model without byte fallback)
                ids.append(self.sp.unk_id())
                at += 1
        return ids


def _json_nodes(value, budget: int) -> int:
    """Nodes of a JSON value, shared ones counted at each use (as its text repeats them), counting
    stops past `budget` (a value built from shared parts can be too large to write out)."""
    count, stack = 0, [value]
    while stack and count <= budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that declares `properties` but says nothing of other keys
    closed to them (`"additionalProperties": false`), as vLLM's default grammar backend and
    OpenAI's strict mode hold them: a model otherwise may write any key, and small ones do.

    A schema that says `additionalProperties`, `unevaluatedProperties` or `patternProperties` keeps
    what it says; `allOf` (whose parts each see only some of the keys) is left as given."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    for key in _ONE_SUBSCHEMA + _SUBSCHEMA_LISTS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    return out


def has_constraint(sampling: SamplingParams) -> bool:
    """Whether the sampling asks for a constraint (without checking it)."""
    return any(v is not None for v in (sampling.json_schema, sampling.regex, sampling.grammar))


def constraint_of(sampling: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of a request's constraint, or None: the key its compiled grammar is cached by.
    RequestError for one past MAX_CONSTRAINT_BYTES."""
    if sampling.json_schema is not None:
        schema = sampling.json_schema
        if (
            not isinstance(schema, str)
            and _json_nodes(schema, MAX_CONSTRAINT_BYTES // 2) > MAX_CONSTRAINT_BYTES // 2
        ):
            raise RequestError(
                f"json_schema is larger than {MAX_CONSTRAINT_BYTES} bytes written out", "json_schema"
            )
        if isinstance(schema, str):
            with contextlib.suppress(ValueError):  # if not JSON, the compiler's error says so
                schema = json.loads(schema)
        text = schema if isinstance(schema, str) else json.dumps(closed_objects(schema))  # key order kept
        key = "json_schema", text
    elif sampling.regex is not None:
        key = "regex", sampling.regex
    elif sampling.grammar is not None:
        key = "grammar", sampling.grammar
    else:
        return None
    if len(key[1].encode("utf-8")) > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"{key[0]} is larger than {MAX_CONSTRAINT_BYTES} bytes", key[0])
    return key


class Grammars:
    """Compiles requests' constraints for one tokenizer, each distinct one once (LRU cached)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._llg_tokenizer = None  # built on the first constrained request (~0.3 s for 49k tokens)
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # servers prepare requests on several threads

    def compile(self, sampling: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled constraint (None without one); RequestError naming the field
        when the schema, expression or grammar is invalid or beyond the parser's limits."""
        key = constraint_of(sampling)
        if key is None:
            return None
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = CompiledGrammar(self._matcher(*key), key[0])
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _vocabulary(self):
        """The tokenizer as llguidance reads it, built on first use."""
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = _llguidance_tokenizer(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            return self._llg_tokenizer

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a special token: its name), whole UTF-8 or not: what
        log-probs report, where decoding one token alone would give U+FFFD for part of a
        character. Ids past the tokenizer's vocabulary (a model's padding) stand for nothing."""
        return self._vocabulary().decode_bytes([token]) if token < self.tokenizer.vocab_size else b""

    def _matcher(self, kind: str, text: str):
        vocabulary = self._vocabulary()
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    text,
                    defaults={"whitespace_flexible": False},  # compact JSON: no runs of blanks
                )
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llg.grammar_from("grammar", text)  # Lark, or GBNF (converted to Lark)
        except (ValueError, RuntimeError) as e:
            raise RequestError(f"invalid {kind}: {e}", kind) from None
        matcher = llg.LLMatcher(vocabulary, grammar, log_level=0, limits=_parser_limits())
        if matcher.is_error():
            raise RequestError(f"invalid {kind}: {_first_line(matcher.get_error())}", kind)
        return matcher


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "rejected by the grammar compiler"
    return line if len(line) <= 300 else line[:297] + "..."


class CompiledGrammar:
    """A compiled constraint, shared by every request that asks for it; `start` copies it."""

    def __init__(self, matcher, kind: str):
        self._matcher = matcher
        self.kind = kind

    def start(self) -> Constraint:
        return Constraint(self._matcher.deep_copy(), self.kind)

    def after_thinking(self, reasoning) -> AfterThinking:
        """The same constraint, held back while a reasoning model thinks (`jinfer.reasoning`)."""
        return AfterThinking(self, reasoning)


class AfterThinking:
    """A compiled constraint for a reasoning model's answer: its thinking goes free."""

    def __init__(self, answer: CompiledGrammar, reasoning):
        self.answer, self.reasoning, self.kind = answer, reasoning, answer.kind

    def start(self) -> ThinkingFirst:
        return ThinkingFirst(self.answer.start(), self.reasoning)


class ThinkingFirst:
    """One request's constraint that lets its thinking be (every token allowed, from the prompt's
    opening marker or its own first token's to the closing one), then holds the answer to the
    grammar: a `Constraint` to the scheduler."""

    def __init__(self, answer: Constraint, reasoning):
        self.answer, self.kind = answer, answer.kind
        self.open_id, self.close_id = reasoning.format.open_id, reasoning.format.close_id
        self.state = "thinking" if reasoning.opened else "start"  # start: thinking may open now

    def accept(self, token: int) -> bool:
        if self.state == "start":
            self.state = "thinking" if token == self.open_id else "answer"
        if self.state == "thinking":
            self.state = "answer" if token == self.close_id else "thinking"
            return True
        return self.answer.accept(token)

    @property
    def complete(self) -> bool:
        return self.state == "answer" and self.answer.complete

    @property
    def error(self) -> str:
        return self.answer.error

    def fill(self, row: np.ndarray) -> None:
        if self.state == "thinking":
            row[:] = ALL_ALLOWED
            return
        self.answer.fill(row)
        if self.state == "start":  # the answer's first tokens, or the thinking's opening marker
            row.view(np.uint32)[self.open_id // 32] |= np.uint32(1 << (self.open_id % 32))


class Constraint:
    """One request's place in its grammar: fed each output token, writes the next allowed set."""

    def __init__(self, matcher, kind: str):
        self._matcher = matcher
        self.kind = kind

    def accept(self, token: int) -> bool:
        """Advance past an output token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Nothing but the end of the output can follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return _first_line(self._matcher.get_error())

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask of the next token into `row` [words] int32."""
        if not row.flags["C_CONTIGUOUS"] or row.dtype != np.int32:
            raise ValueError("an allowed-token row must be a contiguous int32 array")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
