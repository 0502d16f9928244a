"""Tokenizers from tokenizer.json, SentencePiece and GGUF vocabularies; chat templates; streaming."""

import os

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from tiny import CHATML, train_sentencepiece, train_tokenizer

from jinfer import load_tokenizer
from jinfer.tokenizer import IncrementalDetokenizer, TokenizerError

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Grüße aus Köln, ça va? Ελληνικά, Русский, עברית, العربية, हिन्दी",
    "東京は日本の首都です。한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "numbers 1234567890 and symbols #$%&*(){}[]<>",
    "",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hf_tok"))
    train_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A SentencePiece BPE model with byte fallback, trained on the fixed corpus."""
    directory = str(tmp_path_factory.mktemp("sp_tok"))
    train_sentencepiece(directory, TEXTS)
    return directory


@pytest.fixture(scope="module")
def sp_gguf(sp_dir, tmp_path_factory):
    """The same SentencePiece vocabulary written into a GGUF file, as llama.cpp's converter does."""
    sp = spm.SentencePieceProcessor(model_file=os.path.join(sp_dir, "tokenizer.model"))
    path = str(tmp_path_factory.mktemp("sp_gguf") / "vocab.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_streams_like_full_decode(tok, ids):
    """Deltas are whole characters, never retracted, and at the end equal the full decode.

    Whenever the decode of the ids so far is free of U+FFFD (no character is cut in half), all of
    it has been emitted.
    """
    final = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for k in range(1, len(ids) + 1):
        emitted += detok.add([ids[k - 1]])
        assert final.startswith(emitted)
        partial = tok.decode(ids[:k])
        if "\ufffd" not in partial:
            assert emitted == partial, (k, emitted, partial)
    emitted += detok.flush()
    assert emitted == final


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_matches_transformers_and_round_trips(hf_dir, text):
    from transformers import AutoTokenizer

    tok = load_tokenizer(hf_dir)
    reference = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok.encode(text)
    assert ids == reference(text).input_ids
    assert tok.decode(ids) == text
    _assert_streams_like_full_decode(tok, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_model_matches_sentencepiece_and_round_trips(sp_dir, text):
    sp = spm.SentencePieceProcessor(model_file=os.path.join(sp_dir, "tokenizer.model"))
    tok = load_tokenizer(sp_dir)
    ids = tok.encode(text)
    assert ids == [sp.bos_id(), *sp.encode(text)]
    assert tok.decode(ids) == sp.decode(ids[1:])
    assert tok.decode(ids) == text.lstrip(" ") or tok.decode(ids) == text
    _assert_streams_like_full_decode(tok, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_sentencepiece_vocab_matches_sentencepiece(sp_dir, sp_gguf, text):
    sp = spm.SentencePieceProcessor(model_file=os.path.join(sp_dir, "tokenizer.model"))
    tok = load_tokenizer(sp_gguf)
    ids = tok.encode(text)
    assert ids == [sp.bos_id(), *sp.encode(text)]
    assert tok.decode(ids) == sp.decode(ids[1:])
    _assert_streams_like_full_decode(tok, ids)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_gguf_vocab_round_trips_and_streams(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    _assert_streams_like_full_decode(tok, ids)


def test_stream_splits_multibyte_characters_across_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🙂🚀👩‍👩‍👧")
    # Byte-level BPE spends several tokens on each emoji: some tokens alone are not valid UTF-8.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "🙂🚀👩‍👩‍👧"


def test_stream_continues_after_prompt_with_sentencepiece_spaces(sp_dir):
    tok = load_tokenizer(sp_dir)
    prompt = tok.encode("Hello")
    answer = tok.encode(" world and more words", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add([i]) for i in answer) + detok.flush()
    assert tok.decode(prompt + answer) == tok.decode(prompt) + text


def test_chat_template_renders_and_encodes(hf_dir):
    tok = load_tokenizer(hf_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    assert tok.chat_template == CHATML


def test_chat_template_is_sandboxed(hf_dir):
    tok = load_tokenizer(hf_dir)
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_saved_tokenizer_loads_back_identically(hf_dir, sp_dir, tmp_path):
    for source in (hf_dir, sp_dir):
        tok = load_tokenizer(source)
        target = tmp_path / os.path.basename(source)
        tok.save(str(target))
        again = load_tokenizer(str(target))
        for text in TEXTS:
            assert again.encode(text) == tok.encode(text)
        assert again.eos_token_ids == tok.eos_token_ids
        assert again.chat_template == tok.chat_template


def test_missing_and_malformed_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json or tokenizer\.model"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_vocab_sizes(hf_dir, smollm2_tokenizer):
    assert load_tokenizer(hf_dir).vocab_size == 300
    assert smollm2_tokenizer.vocab_size == 49152
    assert np.all(np.array(load_tokenizer(hf_dir).encode("hello")) < 300)
