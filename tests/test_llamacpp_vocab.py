"""llama.cpp's own tokenizer test vectors: every decoder vocabulary of its set (`ggml-vocab-*.gguf`
with `.inp` / `.out` cases, made from each model's tokenizer.json), tokenized by the tokenizer
jinfer builds from the GGUF, must give exactly llama.cpp's ids. The files come from the
llama-cpp-python source archive on PyPI, fetched once (`pip download`) and cached.

Left out: bert-bge (an encoder) and gemma-4 (its "gemma4" tokenizer model belongs to an
architecture jinfer does not serve); gpt-neox, aquila, baichuan and nomic-bert-moe ship no cases.
"""

import pathlib
import subprocess
import sys
import tarfile

import pytest

from jinfer.kernels import cache_dir
from jinfer.loading import load_tokenizer

ARCHIVE = "llama-cpp-python==0.3.36"
VOCABS = (
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocab_dir() -> pathlib.Path:
    cache = cache_dir()
    target = cache / "llama-cpp-vocab-0.3.36"
    if not (target / "ggml-vocab-gpt-2.gguf.out").exists():
        download = cache / "downloads"
        command = [sys.executable, "-m", "pip", "download", ARCHIVE, "--no-deps", "--no-binary", ":all:"]
        run = subprocess.run([*command, "-q", "-d", str(download)], capture_output=True, text=True)
        assert run.returncode == 0, f"could not fetch {ARCHIVE}'s source archive from PyPI: {run.stderr}"
        (archive,) = download.glob("llama_cpp_python-0.3.36.tar.gz")
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = pathlib.PurePosixPath(member.name).name
                if "/vendor/llama.cpp/models/" in member.name and name.startswith("ggml-vocab-"):
                    (target / name).write_bytes(tar.extractfile(member).read())
    return target


def _cases(vocab_dir, name):
    base = vocab_dir / f"ggml-vocab-{name}.gguf"
    texts = (base.parent / (base.name + ".inp")).read_text(encoding="utf-8").split(SEPARATOR)
    assert texts.pop() == ""  # every case, the last too, ends with the separator
    ids = (base.parent / (base.name + ".out")).read_text(encoding="utf-8").split("\n")
    assert len(ids) == len(texts) + 1 and ids[-1] == ""
    return base, [(text, [int(t) for t in line.split()]) for text, line in zip(texts, ids, strict=False)]


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vectors(vocab_dir, name):
    path, cases = _cases(vocab_dir, name)
    assert len(cases) >= 46
    tokenizer = load_tokenizer(str(path))
    wrong = [(text, got, want) for text, want in cases if (got := tokenizer.encode(text, False)) != want]
    assert wrong == [], f"{name}: {len(wrong)} of {len(cases)} cases differ, first: {wrong[0]!r}"


# Text of our own, where transformers' own GGUF conversion of the vocabulary is a reference (four
# pre-tokenizers here; qwen2 and qwen35 agreed as well, at ~17 s each to convert, so they are not
# run every time). For
# some it is not: it ignores Llama 3's "ignore_merges" (llama-bpe) and Falcon's split of digits in
# threes, both of which llama.cpp's vectors (from the models' own tokenizer.json) require.
MULTILINGUAL = [
    "Cửa Việt là một cửa biển",
    "Ελληνικά κείμενα, ΚΕΦΑΛΑΙΑ",
    "日本語のテキストです。カタカナも",
    "한국어 문장입니다",
    "Привет, мир! 1234567",
    "नमस्ते दुनिया",
    "مرحبا بالعالم",
    "🦙🔥 emoji\n\n\tend",
    "  leading   spaces and trailing  ",
    "ǅungla Ωhm Kelvin ﬁ ligature",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-2", "phi-3", "starcoder", "deepseek-coder"])
def test_multilingual_text_matches_transformers_on_the_same_vocabulary(vocab_dir, name):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(vocab_dir), gguf_file=f"ggml-vocab-{name}.gguf")
    ours = load_tokenizer(str(vocab_dir / f"ggml-vocab-{name}.gguf"))
    for text in MULTILINGUAL:
        assert ours.encode(text, False) == reference.encode(text, add_special_tokens=False), (name, text)
