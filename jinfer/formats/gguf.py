"""The GGUF file (read by `gguf_reader`): metadata -> ModelConfig, tensors -> named arrays in
jinfer's layout (what the metadata keys and tensor names mean is the model family's:
`models.family`, found by `general.architecture`), quantized blocks kept or dequantized, and the
vocabulary -> a `tokenizers` object jinfer builds itself: byte-level BPE (`tokenizer.ggml.model == "gpt2"`,
pre-tokenizer chosen by `tokenizer.ggml.pre`) or SentencePiece-style BPE with byte fallback
(`"llama"`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig, UnsupportedModelError
from jinfer.formats.gguf_reader import GGUFFile
from jinfer.formats.hf import named_arrays
from jinfer.formats.params import CheckpointError, LoadedModel, assemble_params, check_vocab
from jinfer.models.family import for_gguf
from jinfer.models.quant_formats import FORMATS, records_from_ggml
from jinfer.models.quantized import HostBlocks
from jinfer.tokenizer import HFBackend, Tokenizer, TokenizerError

log = logging.getLogger(__name__)


def model_config(meta: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
    """A ModelConfig from GGUF key/value metadata (`general.architecture` and `{arch}.*` keys), read
    by the family of that architecture (`models.family`)."""
    return for_gguf(meta.get("general.architecture")).gguf_config(meta, tensor_names, rope_freqs)


def read_gguf(path: str) -> GGUFFile:
    """Open a GGUF file (`gguf_reader`), its failures a clear CheckpointError."""
    if not os.path.exists(path):
        raise CheckpointError(f"missing GGUF file {path}")
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None


_VOCABULARY = ("tokens", "merges", "token_type", "scores")


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Scalar and string metadata, arrays as lists (the vocabulary's big arrays are the tokenizer's)."""
    meta = {}
    for key, value in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(_VOCABULARY):
            continue
        meta[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return meta


# ggml types kept as their blocks (`models.quantized`) when the loader is asked to.
_KEPT = {name: name.lower() for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")}


def dequantize(tensor) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F32:
        array = np.asarray(tensor.data)
    elif kind in (gguf.GGMLQuantizationType.F16,):
        array = np.asarray(tensor.data).astype(np.float32)
    else:
        try:
            array = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise CheckpointError(f"GGUF tensor {tensor.name} has unsupported type {kind.name}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
    return array.reshape(shape)


def _weight(tensor, keep_quantized: bool, dequantized: set[str]) -> np.ndarray | HostBlocks:
    """A tensor's weight: its blocks as they are for a matrix of a kept type (when asked), else its
    values as float32 (quantized types other than those kept are noted in `dequantized`)."""
    kind = tensor.tensor_type.name
    if keep_quantized and kind in _KEPT and len(tensor.shape) == 2:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        fmt = FORMATS[_KEPT[kind]]
        return HostBlocks(fmt, records_from_ggml(fmt, np.asarray(tensor.data)), shape)
    if kind not in ("F32", "F16"):
        dequantized.add(kind)
    return dequantize(tensor)


def load_gguf(path: str, dtype=jnp.float32, quantization: str = "auto", placement=None) -> LoadedModel:
    """A GGUF model. Unless `quantization` is "none", matrices of the types jinfer multiplies
    quantized (`_KEPT`) stay as their blocks; any other type is dequantized
    (logged); "int8" quantizes the float matrices (`assemble_params`). With a `placement` every
    weight goes straight onto its shards, dequantized."""
    keep_quantized = quantization != "none"
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    cfg = model_config(meta, set(tensors), rope_freqs)
    family = for_gguf(meta["general.architecture"])

    dequantized: set[str] = set()

    def as_hf_tensors():
        """GGUF tensors under their Hugging Face names, in Hugging Face's layout (the family's
        `gguf_tensor`); a name the family lacks as it is (reported as unexpected)."""
        for name, tensor in tensors.items():
            if name == "rope_freqs.weight":
                continue  # already folded into the config
            w = _weight(tensor, keep_quantized, dequantized)
            yield family.gguf_tensor(name, w, cfg) or (name, w)

    arrays = named_arrays(cfg, as_hf_tensors())
    if dequantized:
        log.info(
            "%s: %s tensors dequantized to float32 at load (jinfer multiplies %s quantized)",
            path, ", ".join(sorted(dequantized)), ", ".join(_KEPT) if keep_quantized else "none",
        )  # fmt: skip
    params = assemble_params(cfg, arrays, dtype, path, quantization, placement)
    tokenizer = tokenizer_from_gguf(reader, meta)
    check_vocab(cfg, tokenizer, path)
    return LoadedModel(cfg, params, tokenizer, {}, path)


# -------------------------------------------------------------------------------- GGUF vocab
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

# Each pre-tokenizer is a list of regexes applied in turn, each splitting the pieces the one
# before left (matches and the stretches between them become pieces), then the byte-level
# mapping; these are the splits of the models' own tokenizer.json files, with which llama.cpp
# names them in `tokenizer.ggml.pre`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letters, punctuation and CJK classes (from its tokenizer.json; escaped, since
# several of these code points are not in normal form C and an editor may silently change them).
_DEEPSEEK_LETTERS = (
    r"\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126"
    "\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f"
    "\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
    "]+"
)
_DEEPSEEK_PUNCTUATION = r"\s?[" + "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs (and what lies between them), Hangul
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "mpt": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # each digit alone, then GPT-2's split
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCTUATION, r"\s+$", _CJK, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ),
}
# Pre-tokenizers whose BPE takes a whole piece that is in the vocabulary as it is, before any merge
# (Llama 3's tokenizer.json: "ignore_merges": true); without it "Việt" came out in three tokens.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})


def _byte_level_pre_tokenizer(pre: str):
    """The pre-tokenizer for a GGUF's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, pre_tokenizers

    splits = _PRE_TOKENIZERS.get(pre)
    if splits is None:
        known = ", ".join(sorted(_PRE_TOKENIZERS))
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer pre-tokenizer {pre!r} (jinfer reads {known})"
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def tokenizer_from_gguf(reader, meta: dict[str, Any]) -> Tokenizer:
    """Build a `tokenizers` tokenizer from the vocabulary stored in a GGUF file."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise TokenizerError("GGUF file has no tokenizer.ggml.tokens vocabulary")
    types = reader.fields.get("tokenizer.ggml.token_type")
    types = np.full(len(tokens), _TOKEN_NORMAL) if types is None else np.asarray(types)
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
        HFBackend(tok),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _gguf_byte_level_bpe(reader, meta, tokens):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    merges = reader.fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = meta.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_sentencepiece_bpe(reader, meta, tokens, types):
    """SentencePiece-style BPE: merges ranked by the merged piece's score, bytes as <0xXX> tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    scores = reader.fields.get("tokenizer.ggml.scores")
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


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a GGUF file, without reading its tensors."""
    reader = read_gguf(path)
    return tokenizer_from_gguf(reader, gguf_metadata(reader))
