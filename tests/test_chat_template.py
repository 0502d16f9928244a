"""How a chat renders beyond its messages (`jinfer.prepare.ChatTemplate`, vLLM's fields): the final
assistant message continued, variables the template reads, and the checks, through the one
preparation path every door takes."""

import copy

import pytest
from test_tools import preparer, tokenizer  # noqa: F401 - fixtures

from jinfer.prepare import ChatTemplate, RequestPreparer
from jinfer.sampling import RequestError

STARTED = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]


def test_the_final_assistant_message_is_continued_from_its_last_character(preparer, tokenizer):  # noqa: F811
    template = ChatTemplate(add_generation_prompt=False, continue_final_message=True)
    prompt = tokenizer.decode(preparer.prepare(messages=STARTED, template=template).prompt_ids, False)
    closed = tokenizer.apply_chat_template(STARTED, add_generation_prompt=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert closed.startswith(prompt) and closed[len(prompt) :].startswith("<|im_end|>")
    opened = tokenizer.decode(preparer.prepare(messages=STARTED).prompt_ids, False)
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")  # by default: a new turn


def test_template_variables_reach_the_template(tokenizer):  # noqa: F811
    thinking = copy.copy(tokenizer)
    thinking.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    reading = RequestPreparer(
        thinking,
        vocab_size=thinking.vocab_size,
        max_seq_len=512,
        eos_token_ids=thinking.eos_token_ids,
        sampling_defaults={},
        context_policy="error",
    )
    ask = STARTED[:1]
    off = ChatTemplate(variables={"enable_thinking": False})
    assert "/no_think" in thinking.decode(reading.prepare(messages=ask, template=off).prompt_ids)
    assert "/no_think" not in thinking.decode(reading.prepare(messages=ask).prompt_ids)


@pytest.mark.parametrize(
    "template, messages, param",
    [
        (ChatTemplate(continue_final_message=True), STARTED, "continue_final_message"),  # both
        (ChatTemplate(False, True), STARTED[:1], "continue_final_message"),  # nothing to continue
        (ChatTemplate(variables={"messages": []}), STARTED, "chat_template_kwargs"),  # jinfer's own
        (ChatTemplate(variables=["x"]), STARTED, "chat_template_kwargs"),
        (ChatTemplate(add_generation_prompt="yes"), STARTED, "add_generation_prompt"),
    ],
)
def test_contradicting_options_name_the_field(preparer, template, messages, param):  # noqa: F811
    with pytest.raises(RequestError) as caught:
        preparer.prepare(messages=messages, template=template)
    assert caught.value.param == param
