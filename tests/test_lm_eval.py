"""lm-eval as evaluators run it against a server: its `local-completions` and
`local-chat-completions` models against a real `jinfer serve` of the embedded SmolLM2 in float32,
with lm-eval's default tokenizer setting (it finds /tokenizer_info and tokenizes through the
server), on small local tasks of each kind; every item's log-likelihood equals lm-eval's `hf`
backend's on the same float32 weights (transformers reading the same GGUF) within 1e-4, and the
greedy answers are the same."""

import json
import os

import httpx
import lm_eval
import lm_eval.tasks
import pytest
from test_server import running_server

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files

CHOICES = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " loud"], "answer": 0},
    {  # answers after which the instruct model ends its turn: the end of sequence is generated
        "question": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "choices": ["The capital of France is Paris.", "The capital of France is Rome."],
        "answer": 0,
    },
]
TEXTS = [
    {"text": "Once upon a time, there was a little girl named Emma. She loved to play in the sun."},
    {"text": "The quick brown fox jumps over the lazy dog. It is a sentence of the alphabet."},
]
QUESTIONS = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: How many legs does a spider have?\nA:", "answer": " Eight"},
]


def _task(folder, name: str, rows: list[dict], spec: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    head += "test_split: test\n"
    (folder / f"{name}.yaml").write_text(head + spec)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Three local tasks: multiple choice (log-likelihoods), rolling log-likelihood, generate-until."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    _task(
        folder,
        "jinfer_choices",
        CHOICES,
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
    )
    _task(
        folder,
        "jinfer_rolling",
        TEXTS,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n",
    )
    _task(
        folder,
        "jinfer_until",
        QUESTIONS,
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "Q:"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    )
    return lm_eval.tasks.TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def server(smollm2_path):
    options = ["--quantization", "none", "--max-slots", "4", "--max-seq-len", "512"]
    with running_server(smollm2_path, *options, "--served-model-name", "smollm2") as (base, _):
        yield base


def _run(model: str, model_args: str, names: list[str], manager, **options) -> dict:
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=names, task_manager=manager, log_samples=True, **options
    )
    # Per task, its requests' results in order: (log-likelihood, greedy) pairs, or answers.
    return {
        name: [[resp for resp in sample["filtered_resps"]] for sample in out["samples"][name]]
        for name in names
    }


def _values(results: list[list]) -> list[float]:
    flat = []
    for sample in results:
        for resp in sample:
            flat.append(float(resp[0]) if isinstance(resp, list | tuple) else float(resp))
    return flat


def test_local_completions_scores_as_the_hf_backend_does(server, tasks, smollm2_path):
    directory, name = os.path.split(smollm2_path)
    names = ["jinfer_choices", "jinfer_rolling", "jinfer_until"]
    args = f"model=smollm2,base_url={server}/v1/completions,num_concurrent=1,max_retries=1,max_length=512"
    ours = _run("local-completions", args, names, tasks)
    hf_args = f"pretrained={directory},gguf_file={name},dtype=float32,max_length=512"
    theirs = _run("hf", hf_args, names, tasks, batch_size=1, device="cpu")
    got, want = _values(ours["jinfer_choices"]), _values(theirs["jinfer_choices"])
    assert len(got) == len(want) == sum(len(row["choices"]) for row in CHOICES)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1e-4
    # A rolling log-likelihood sums a whole text's tokens: within 1e-4 per token.
    got, want = _values(ours["jinfer_rolling"]), _values(theirs["jinfer_rolling"])
    for row, g, w in zip(TEXTS, got, want, strict=True):
        tokens = httpx.post(server + "/tokenize", json={"prompt": row["text"]}).json()["count"]
        assert abs(g - w) <= 1e-4 * tokens, (g, w, tokens)
    assert ours["jinfer_until"] == theirs["jinfer_until"]
    assert any("Paris" in answer for sample in ours["jinfer_until"] for answer in sample)


def test_local_chat_completions_answers_as_the_hf_backend_does(server, tasks, smollm2_path):
    directory, name = os.path.split(smollm2_path)
    args = f"model=smollm2,base_url={server}/v1/chat/completions,num_concurrent=1,max_retries=1"
    ours = _run("local-chat-completions", args, ["jinfer_until"], tasks, apply_chat_template=True)
    hf_args = f"pretrained={directory},gguf_file={name},dtype=float32"
    theirs = _run(
        "hf", hf_args, ["jinfer_until"], tasks, batch_size=1, device="cpu", apply_chat_template=True
    )
    assert ours["jinfer_until"] == theirs["jinfer_until"]
    assert any("Paris" in answer for sample in ours["jinfer_until"] for answer in sample)
