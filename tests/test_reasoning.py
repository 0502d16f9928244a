"""Reasoning models (`jinfer.reasoning`): the thinking told apart from the answer, whole and as it
streams; a thinking budget kept on the device (the closing marker where it is due, nothing else
changed, alone or in a crowd); `enable_thinking`; structured output held to the answer only; the
server's `reasoning_content` / `reasoning` and Responses reasoning items. The model is a tiny
random Qwen3 of `<think>` / `</think>` tokens whose template opens the thinking (DeepSeek-R1's
way) or, with enable_thinking false, closes an empty block."""

import dataclasses
import json
import random

import anthropic
import httpx
import openai
import pytest
from test_server import AUTH, KEY, TINY_OPTIONS, running_server
from tiny import build_reasoning_model

import jinfer
from jinfer.prepare import ChatTemplate
from jinfer.reasoning import Reasoning, ReasoningFormat, ReasoningStream

FORMAT = ReasoningFormat(open_id=300, close_id=301, special=False)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("thinker"))
    build_reasoning_model(directory)
    return directory


@pytest.fixture(scope="module")
def llm(thinker):
    return jinfer.LLM(thinker, max_slots=4, max_seq_len=128)


def _streamed(reasoning: Reasoning, text: str, seed: int) -> tuple[str, str]:
    """The text fed in random pieces: the thinking and the answer as a stream sends them."""
    stream, cuts = ReasoningStream(reasoning), random.Random(seed)
    thinking, answer, at = [], [], 0
    while at < len(text):
        step = cuts.randint(1, 5)
        t, a = stream.add(text[at : at + step])
        thinking.append(t), answer.append(a)
        at += step
    t, a = stream.finish()
    return "".join(thinking) + t, "".join(answer) + a


@pytest.mark.parametrize(
    "opened, text, want",
    [
        (True, "\nLet me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
        (True, "still thinking, cut <", ("still thinking, cut <", "")),
        (True, "</think>Paris", ("", "Paris")),
        (False, "  <think>\nhmm </th</think>\nParis </think>", ("hmm </th", "Paris </think>")),
        (False, "Paris, straight away.", (None, "Paris, straight away.")),
        (False, "<thin", (None, "<thin")),
    ],
)
def test_thinking_is_split_the_same_whole_and_streamed(opened, text, want):
    reasoning = Reasoning(FORMAT, opened)
    assert reasoning.split(text) == want
    for seed in range(20):
        assert _streamed(reasoning, text, seed) == (want[0] or "", want[1])


def test_where_the_thinking_starts_is_read_from_the_prompt():
    assert Reasoning.of_prompt(FORMAT, [5, 6, 300, 9], None).opened  # the template opened it
    assert Reasoning.of_prompt(FORMAT, [5, 300, 9, 301, 9], 3) is None  # an empty block: no thinking
    later = Reasoning.of_prompt(FORMAT, [300, 9, 301, 7, 8, 9, 10, 11, 12], 3)  # an earlier turn's
    assert not later.opened and later.knobs() == (300, 301, 4)  # the model's own marker counts


def test_a_budget_closes_the_thinking_where_it_is_due_and_changes_nothing_before(llm):
    free = jinfer.SamplingParams(max_tokens=16, temperature=0)
    (alone,) = llm.chat([CHAT], free)
    assert FORMAT.close_id not in alone.token_ids[:6]  # this model does not close it by itself soon
    for budget in (0, 3, 5):
        (held,) = llm.chat(
            [CHAT], jinfer.SamplingParams(max_tokens=16, temperature=0, max_reasoning_tokens=budget)
        )
        assert held.token_ids[:budget] == alone.token_ids[:budget]
        assert held.token_ids[budget] == FORMAT.close_id
        assert held.metrics["reasoning_tokens"] == budget + 1
        tokenizer = llm.tokenizer
        assert held.reasoning == tokenizer.decode(held.token_ids[:budget]).strip()
        assert held.text == tokenizer.decode(held.token_ids[budget + 1 :]).lstrip()
    assert alone.reasoning == llm.tokenizer.decode(alone.token_ids).strip() and alone.text == ""


def test_budgeted_outputs_are_the_same_alone_and_in_a_crowd(llm):
    samplings = [
        jinfer.SamplingParams(max_tokens=12, temperature=0.8, seed=s, max_reasoning_tokens=s % 4)
        for s in range(6)
    ]
    chats = [[{"role": "user", "content": f"Question {s}?"}] for s in range(6)]
    alone = [llm.chat([c], [s])[0] for c, s in zip(chats, samplings, strict=True)]
    crowd = llm.chat(chats, samplings)
    assert [c.token_ids for c in crowd] == [c.token_ids for c in alone]
    assert all(c.token_ids[s % 4] == FORMAT.close_id for s, c in enumerate(crowd))


def test_budgeted_requests_preempted_mid_thought_resume_with_the_same_tokens(thinker, llm):
    """A pool for two full sequences, eight budgeted generations: they are preempted (some in the
    middle of their thinking) and resumed, each with its solo tokens and its marker where due."""
    small = jinfer.LLM(
        thinker, max_slots=8, max_seq_len=128, kv_cache_tokens=256, page_size=16, decode_steps=4
    )
    chats = [[{"role": "user", "content": f"Question number {s}?"}] for s in range(8)]
    samplings = [
        jinfer.SamplingParams(
            max_tokens=90, temperature=0.8, seed=s, max_reasoning_tokens=20 + 5 * s, ignore_eos=True
        )
        for s in range(8)
    ]
    crowded = small.chat(chats, samplings)
    assert small.engine.stats()["preemptions"] > 0
    assert [c.token_ids for c in crowded] == [
        llm.chat([c], [s])[0].token_ids for c, s in zip(chats, samplings, strict=True)
    ]
    # Sampled, the model may close its thinking before the budget by itself; never after.
    closed = [c.token_ids.index(FORMAT.close_id) for c in crowded]
    due = [20 + 5 * s for s in range(8)]
    assert all(at <= budget for at, budget in zip(closed, due, strict=True)), closed
    assert sum(at == budget for at, budget in zip(closed, due, strict=True)) >= 4, closed


def test_an_output_that_opens_its_thinking_itself_spends_its_budget_after_the_marker(llm):
    """With the thinking opened by the model (here made to, by a bias on the marker), the budget
    counts from after its own opening token."""
    ids = llm.preparer.chat_ids(CHAT)
    ids = ids[: len(ids) - 1 - ids[::-1].index(FORMAT.open_id)]  # the prompt before the template's marker
    sampling = jinfer.SamplingParams(
        max_tokens=8, temperature=0, max_reasoning_tokens=2, logit_bias={FORMAT.open_id: 100.0}
    )
    prepared = llm.preparer.prepare(ids, sampling=sampling)
    reasoning = Reasoning(llm.preparer.reasoning_format, opened=False, budget=2)
    ((_, done),) = list(llm.iter_completions([dataclasses.replace(prepared, reasoning=reasoning)]))
    assert done.token_ids[:4] == [FORMAT.open_id] * 3 + [FORMAT.close_id]
    assert done.reasoning == "<think><think>" and done.text.startswith("<think>")


def test_enable_thinking_false_answers_at_once(llm):
    prepared = llm.preparer.prepare(
        messages=CHAT,
        sampling=jinfer.SamplingParams(max_tokens=6, temperature=0, max_reasoning_tokens=0),
        template=ChatTemplate(variables={"enable_thinking": False}),
    )
    assert prepared.reasoning is None
    ((_, done),) = list(llm.iter_completions([prepared]))
    assert done.reasoning is None and FORMAT.close_id not in done.token_ids


def test_structured_output_holds_the_answer_not_the_thinking(llm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    }
    sampling = jinfer.SamplingParams(max_tokens=60, temperature=0, max_reasoning_tokens=4, json_schema=schema)
    (done,) = llm.chat([CHAT], sampling)
    free = llm.chat([CHAT], jinfer.SamplingParams(max_tokens=4, temperature=0))[0]
    assert done.token_ids[:4] == free.token_ids  # the thinking went as it would unconstrained
    assert done.token_ids[4] == FORMAT.close_id
    assert done.finish_reason == "stop" and isinstance(json.loads(done.text)["city"], str), done.text


def test_server_returns_the_thinking_apart(thinker):
    with running_server(thinker, *TINY_OPTIONS) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0}
        whole = httpx.post(
            base + "/v1/chat/completions", json={**body, "max_reasoning_tokens": 4}, headers=AUTH
        )
        message = whole.json()["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] and message["reasoning_content"]
        assert whole.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
        stream = client.chat.completions.create(**body, stream=True, extra_body={"max_reasoning_tokens": 4})
        thinking, content = [], []
        for chunk in stream:
            delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
            thinking.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
        assert "".join(thinking) == message["reasoning_content"] and "".join(content) == message["content"]
        effortless = client.chat.completions.create(**body, reasoning_effort="none").model_dump()
        assert effortless["choices"][0]["message"]["reasoning_content"] == ""
        assert effortless["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
        # A budget past max_output_tokens: the whole output is thinking.
        asked = {"model": "tiny", "input": "Why?", "max_output_tokens": 12, "temperature": 0}
        response = client.responses.create(**asked, reasoning={"effort": "minimal"})
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.usage.output_tokens_details.reasoning_tokens == 12
        events = list(client.responses.create(**asked, reasoning={"effort": "minimal"}, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        done = events[-1].response
        assert done.output[0].type == "reasoning" and done.output[0].content[0].text == deltas
        assert deltas == response.output[0].content[0].text and deltas
        # Anthropic's Messages: a thinking block before the text, its budget from `thinking`.

        claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        ask = {"model": "tiny", "max_tokens": 12, "messages": CHAT, "extra_body": {"temperature": 0}}
        budgeted = {"type": "enabled", "budget_tokens": 3}
        answer = claude.messages.create(**ask, thinking=budgeted)
        assert [block.type for block in answer.content] == ["thinking", "text"]
        with claude.messages.stream(**ask, thinking=budgeted) as stream:
            streamed = stream.get_final_message()
        assert [
            (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content
        ] == [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in answer.content]
        unthinking = claude.messages.create(**ask, thinking={"type": "disabled"})
        assert [block.type for block in unthinking.content] == ["text"]
