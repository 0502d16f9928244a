"""The chat page at `/` in a real browser: headless Chromium (Debian's chromium and chromium-driver,
driven by selenium) against a real `jinfer serve` of the embedded SmolLM2 with an API key.

Streaming, greedy answers equal to the openai client's, Stop freeing the slot, model output and
prompts shown as text, the API-key prompt, errors and recovery, phone and desktop widths.
Screenshots of finished answers are kept under results/. The same server answers the official
`openai` client's SmolLM2 test."""

import json
import pathlib
import shutil
import threading
import time

import httpx
import openai
import pytest
from test_server import AUTH, KEY, _metric, _wait_metric, running_server

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"
SERVER_OPTIONS = [
    "--api-key", KEY,
    "--served-model-name", "smollm2",
    "--max-slots", "2",
    "--max-queue", "1",
    "--max-seq-len", "2048",
    "--max-num-batched-tokens", "128",
]  # fmt: skip
# What Chromium needs here: no sandbox as root, and no background connections (the network is closed).
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
PHONE = {"width": 375, "height": 812, "deviceScaleFactor": 2, "mobile": True}
FINISHED = ("done", "stopped", "error")


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path, *SERVER_OPTIONS) as (base, _):
        yield base


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("the chat page's tests need chromium and chromedriver (Debian: chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


class Page:
    """The chat page in the browser, read and driven the way a person would, plus its stored state."""

    def __init__(self, driver, base: str):
        self.driver, self.base = driver, base

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def find(self, element_id: str):
        return self.driver.find_element("id", element_id)

    def open(self, *, fresh: bool = True) -> None:
        self.driver.get(self.base + "/")
        if fresh:
            self.js("sessionStorage.clear(); localStorage.clear();")
            self.driver.get(self.base + "/")

    def key_dialog_open(self) -> bool:
        return self.js("return document.getElementById('key-dialog').open")

    def give_key(self, key: str) -> None:
        wait_for(self.key_dialog_open, "the API-key dialog")
        self.find("key-input").send_keys(key)
        self.find("key-ok").click()

    def models(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('#model option')].map(o => o.value)")

    def set(self, element_id: str, value: str) -> None:
        field = self.find(element_id)
        field.clear()
        field.send_keys(value)

    def answers(self) -> list[dict]:
        return self.js(
            "return [...document.querySelectorAll('.message.assistant')].map(a => ({state: a.dataset.state,"
            " text: a.querySelector('.content').textContent, stats: a.querySelector('.stats').textContent}))"
        )

    def send(self, text: str) -> int:
        """Types `text` and presses Enter; the index its answer will have."""
        index = len(self.answers())
        self.find("prompt").send_keys(text + "\n")
        return index

    def answer(self, index: int, timeout: float = 120) -> dict:
        def finished():
            answers = self.answers()
            return len(answers) > index and answers[index]["state"] in FINISHED and answers[index]

        return wait_for(finished, f"answer {index}", timeout)

    def conversation(self) -> list[dict]:
        return json.loads(self.js("return sessionStorage.getItem('jinfer.conversation')") or "[]")

    def error(self) -> str:
        return self.js("const e = document.getElementById('error'); return e.hidden ? '' : e.textContent")

    def screenshot(self, name: str) -> None:
        RESULTS.mkdir(exist_ok=True)
        self.driver.save_screenshot(str(RESULTS / name))


@pytest.fixture
def page(server, browser):
    """The page fresh (no conversation, settings or key) at a desktop size, the key given."""
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    browser.set_window_size(1280, 900)
    page = Page(browser, server)
    page.open()
    page.give_key(KEY)
    wait_for(lambda: page.models() == ["smollm2"], "the model list")
    return page


def greedy_reference(server: str, messages: list[dict], max_tokens: int):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    return client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=max_tokens
    )


def is_subsequence(shown: str, source: str) -> bool:
    characters = iter(source)
    return all(c in characters for c in shown)


@pytest.mark.slow
def test_smollm2_answers_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=30, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == answer.choices[0].message.content


# Records the last answer's (state, text) at every change of the conversation, as it happens.
RECORD_CHANGES = """
window.seen = [];
new MutationObserver(() => {
  const a = [...document.querySelectorAll('.message.assistant')].pop();
  if (a) window.seen.push([a.dataset.state, a.querySelector('.content').textContent]);
}).observe(document.getElementById('conversation'),
           {childList: true, subtree: true, characterData: true, attributes: true});
"""


@pytest.mark.slow
def test_answers_stream_in_and_equal_the_openai_clients_greedy_answers(page, server):
    system = "You are a helpful assistant. Answer in one sentence."
    page.set("system", system)
    page.set("temperature", "0")
    page.set("max-tokens", "40")
    page.js(RECORD_CHANGES)
    first = page.answer(page.send("What is the capital of France?"))
    assert first["state"] == "done" and page.error() == ""
    second = page.answer(page.send("And of Germany?"))
    assert second["state"] == "done"

    turns = page.conversation()
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    messages = [{"role": "system", "content": system}]
    for turn, shown in ((0, first), (2, second)):
        messages.append({"role": "user", "content": turns[turn]["content"]})
        expected = greedy_reference(server, messages, 40)
        answer = turns[turn + 1]
        assert answer["content"] == expected.choices[0].message.content  # the page kept the conversation
        messages.append({"role": "assistant", "content": answer["content"]})
        assert answer["stats"]["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
        assert answer["stats"]["usage"]["completion_tokens"] == expected.usage.completion_tokens
        assert f"{expected.usage.completion_tokens} completion tokens" in shown["stats"]
        assert "first token" in shown["stats"] and "tokens/s" in shown["stats"]
        # What is on screen is the answer, markdown syntax aside.
        assert is_subsequence("".join(shown["text"].split()), "".join(answer["content"].split()))
    assert "Paris" in turns[1]["content"]

    streaming = {text for state, text in page.js("return window.seen") if state == "streaming" and text}
    assert len(streaming) >= 3, "the answers did not grow on screen before they were done"
    page.screenshot("webpage-answer.png")

    page.open(fresh=False)  # a reload shows the conversation again
    wait_for(lambda: len(page.answers()) == 2, "the conversation after a reload")
    assert [a["text"] for a in page.answers()] == [first["text"], second["text"]]
    page.find("new-chat").click()
    assert page.answers() == [] and page.conversation() == []


@pytest.mark.slow
def test_stop_cancels_the_stream_and_frees_the_slot(page, server):
    aborted = 'jinfer_requests_finished_total{finish_reason="abort"}'
    count = lambda: (
        _metric(server, aborted) if aborted in httpx.get(server + "/metrics", headers=AUTH).text else 0
    )
    before = count()
    page.set("max-tokens", "1500")
    page.set("extra", '{"ignore_eos": true}')
    index = page.send("Tell me a long story.")
    wait_for(lambda: len(page.answers()) > index and page.answers()[index]["text"], "the first tokens")
    assert page.answers()[index]["state"] == "streaming"
    page.find("stop").click()
    stopped = page.answer(index, timeout=10)
    assert stopped["state"] == "stopped" and "stopped" in stopped["stats"]
    _wait_metric(server, "jinfer_slots_in_use", 0.0)
    wait_for(lambda: count() == before + 1, "the abort counted", timeout=30)  # after the slot is freed
    kept = page.conversation()[-1]
    assert kept["stats"]["finish_reason"] == "stopped" and kept["content"]

    page.set("max-tokens", "5")  # the page goes on
    assert page.answer(page.send("Hello"))["state"] == "done"


@pytest.mark.slow
def test_model_output_and_prompts_render_as_text_and_code_as_code(page):
    code = "def add(a, b):\n    return a + b"
    hostile = (
        '<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> '
        "[click](javascript:window.pwned=3) [docs](https://example.com/docs)"
    )
    forced = f"Here it is:\n\n```python\n{code}\n```\n\n{hostile}"
    regex = "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in forced)
    page.set("system", '<img src=x onerror="window.pwned = 4"> Answer.')
    page.set("max-tokens", "200")
    page.set("extra", json.dumps({"regex": regex}))
    shown = page.answer(page.send("<script>window.pwned = 5</script> show me"))
    assert shown["state"] == "done"
    assert page.conversation()[-1]["content"] == forced

    assert page.js("return window.pwned") is None
    created = "#conversation script, #conversation img, #conversation iframe, #conversation svg"
    assert page.js(f"return document.querySelectorAll('{created}').length") == 0
    assert page.js("return [...document.querySelectorAll('#conversation a')].map(a => a.href)") == [
        "https://example.com/docs"
    ]
    for text in ("<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">'):
        assert text in shown["text"]
    assert "[click](javascript:window.pwned=3)" in shown["text"]
    user = page.js("return document.querySelector('.message.user').textContent")
    assert user == "<script>window.pwned = 5</script> show me"
    blocks = page.js(
        "return [...document.querySelectorAll('#conversation pre.code code')]"
        ".map(c => [c.textContent, c.dataset.language])"
    )
    assert blocks == [[code, "python"]]


@pytest.mark.slow
def test_the_page_asks_for_the_api_key_once_and_keeps_it_for_the_tab(server, browser):
    assert httpx.get(server + "/").status_code == 200  # the page itself needs no key...
    assert httpx.get(server + "/ui/chat.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server + "/v1/models").status_code == 401  # ...the API still does
    assert "script-src 'self'" in httpx.get(server + "/").headers["content-security-policy"]

    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    page = Page(browser, server)
    page.open()
    assert wait_for(page.key_dialog_open, "the key dialog")
    page.give_key("wrong-key")
    wait_for(lambda: "refused" in page.find("key-message").text, "the refusal")
    assert page.models() == []
    page.give_key(KEY)
    wait_for(lambda: page.models() == ["smollm2"], "the model list")
    assert not page.key_dialog_open()
    assert page.js("return sessionStorage.getItem('jinfer.apiKey')") == KEY

    page.open(fresh=False)  # a reload: the tab still has the key
    wait_for(lambda: page.models() == ["smollm2"], "the model list after a reload")
    assert not page.key_dialog_open()


@pytest.mark.slow
def test_errors_read_as_sentences_and_the_page_recovers(page, server):
    page.set("max-tokens", "5000")  # past the 2048-token context
    page.send("Hello")
    message = wait_for(page.error, "the context error")
    assert message.startswith("Too long for the model's context: ") and "2048" in message
    assert page.find("prompt").get_attribute("value") == "Hello"  # the question is back in the box
    assert page.answers() == [] and page.conversation() == []

    # 2 slots and 1 queue place, all taken: the page's request gets a 429.
    release = threading.Event()

    def hold():
        body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}  # held till released
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    return  # closing the connection cancels the request

    holders = [threading.Thread(target=hold) for _ in range(3)]
    try:
        # One at a time: requests arriving together could fill the one queue place before the
        # engine moves the first into a slot, and a holder would get the 429 meant for the page.
        for thread, (gauge, value) in zip(
            holders, [("running", 1.0), ("running", 2.0), ("waiting", 1.0)], strict=True
        ):
            thread.start()
            _wait_metric(server, f"jinfer_requests_{gauge}", value, timeout=120)
        page.find("prompt").clear()
        page.set("max-tokens", "5")
        page.send("Hello again")
        message = wait_for(page.error, "the 429 message")
        assert message.startswith("The server is busy: ") and message.endswith("Try again in 1 s.")
        assert page.answers() == []
    finally:
        release.set()
        for thread in holders:
            if thread.ident is not None:  # started
                thread.join()
    _wait_metric(server, "jinfer_slots_in_use", 0.0)
    page.find("prompt").clear()
    assert page.answer(page.send("Hello again"))["state"] == "done"
    assert page.error() == ""


@pytest.mark.slow
@pytest.mark.parametrize("viewport", ["phone", "desktop"])
def test_the_page_works_at_phone_and_desktop_widths(page, browser, viewport):
    if viewport == "phone":
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
        page.open(fresh=False)
        wait_for(lambda: page.models() == ["smollm2"], "the model list")
        assert page.js("return innerWidth") == 375
        assert page.js("return document.getElementById('settings').open") is False  # folded away
        page.find("settings").find_element("tag name", "summary").click()  # open the settings
    page.set("temperature", "0")
    page.set("max-tokens", "120")
    if viewport == "phone":
        page.find("settings").find_element("tag name", "summary").click()  # and fold them again
    shown = page.answer(page.send("Write a Python function that adds two numbers."))
    assert shown["state"] == "done"
    assert page.js("return document.querySelectorAll('#conversation pre.code').length") >= 1
    width, height = page.js("return [innerWidth, innerHeight]")
    assert page.js("return document.documentElement.scrollWidth") <= width  # nothing sideways
    for element_id in ("prompt", "send", "new-chat", "model"):  # all on screen
        box = page.js(f"return document.getElementById('{element_id}').getBoundingClientRect().toJSON()")
        assert box["left"] >= 0 and box["top"] >= 0 and box["width"] > 0, element_id
        assert box["right"] <= width and box["bottom"] <= height, element_id
    page.screenshot(f"webpage-{viewport}.png")


@pytest.mark.slow
def test_while_the_server_warms_up_the_page_says_so_and_keeps_the_question(smollm2_path, browser):
    # A server at its default settings warms up for about a minute, far longer than this takes.
    with running_server(smollm2_path, until="/health") as (base, _):
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        page = Page(browser, base)
        page.open()
        wait_for(lambda: page.models() == ["smollm2-135m-instruct"], "the model list")
        page.send("Hello")
        message = wait_for(page.error, "the warm-up message")
        assert httpx.get(base + "/ready").status_code == 503  # still warming up when it answered
    assert message == "The server is warming up. Try again in 5 s."
    assert page.find("prompt").get_attribute("value") == "Hello" and page.answers() == []


def test_no_web_ui_leaves_the_root_unanswered(smollm2_path):
    with running_server(smollm2_path, "--no-web-ui", until="/health") as (base, _):  # routes precede warm-up
        assert httpx.get(base + "/").status_code == 404
        assert httpx.get(base + "/ui/chat.js").status_code == 404
