"""The chat page at ``/`` in headless Chromium, against a real server process (the fake model at
20 ms a step, with an API key): the key prompt, a streamed reply, multi-turn history, Stop, errors
(before and inside a stream), markup shown as text, the status strip, and the layout on a laptop
and a phone. Set ``TRIO_INFER_DOCS_SCREENSHOT=1`` to retake docs/chat-page.png (with the default
model when it is in the cache)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.api.helpers import metric
from tests.browser.conftest import KEY, MARKUP_MODEL, Server, start_server, stop_server
from tests.runtime.test_worker_process import children, health, wait_for
from trio_infer.settings import Settings

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "chat-page.png"

_MESSAGES_JS = """
return [...document.querySelectorAll('#messages > li')].map((li) => ({
  kind: li.classList[1],
  role: li.querySelector('.role').textContent,
  text: li.querySelector('.text').textContent,
  meta: li.querySelector('.meta').textContent,
  elements: li.querySelectorAll('.text *, .role *').length,
  excluded: li.classList.contains('excluded'),
  finish: li.dataset.finish || null,
  prompt_tokens: li.dataset.promptTokens ? Number(li.dataset.promptTokens) : null,
  completion_tokens: li.dataset.completionTokens ? Number(li.dataset.completionTokens) : null,
}));
"""

_STATUS_JS = """
const t = (id) => document.getElementById(id).textContent;
return {
  health: t('st-health-text'), running: t('st-running'), waiting: t('st-waiting'),
  kv_used: t('st-kv-used'), kv_cached: t('st-kv-cached'), kv_total: t('st-kv-total'),
  tps: t('st-tps'), spark: document.getElementById('spark-line').getAttribute('points'),
};
"""

# Records the length of the newest reply's text at every change of the conversation.
_OBSERVE_JS = """
window.replyLengths = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('#messages li.assistant .text');
  if (replies.length) window.replyLengths.push(replies[replies.length - 1].textContent.length);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


class Page:
    """The chat page in the browser, and the server behind it."""

    def __init__(self, driver: Any, server: Server) -> None:
        self.driver = driver
        self.server = server

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def open(self, key: str | None = KEY) -> None:
        """Load the page; give the key if it asks for one; wait for the model id."""
        self.driver.get(self.server.url + "/")
        wait_for(lambda: self.key_asked() or self.model_shown(), 10, "the page to load")
        if self.key_asked():
            self.give_key(key or "")
        wait_for(self.model_shown, 10, "the model id")

    def key_asked(self) -> bool:
        return bool(self.js("return document.getElementById('key-dialog').open"))

    def give_key(self, key: str) -> None:
        field = self.driver.find_element("id", "key")
        field.clear()
        field.send_keys(key + "\n")

    def model_shown(self) -> bool:
        return self.js("return document.getElementById('model').textContent") == self.server.model

    def set(self, field: str, value: str) -> None:
        self.js("document.getElementById(arguments[0]).value = arguments[1]", field, value)

    def busy(self) -> bool:
        return bool(self.js("return document.body.classList.contains('busy')"))

    def send(self, text: str, wait: bool = True) -> None:
        before = len(self.messages())
        self.driver.find_element("id", "input").send_keys(text + "\n")
        wait_for(lambda: len(self.messages()) > before, 5, "the message to be sent")
        if wait:
            self.wait_idle()

    def wait_idle(self, timeout: float = 20) -> None:
        wait_for(lambda: not self.busy(), timeout, "the reply to end")

    def messages(self) -> list[dict[str, Any]]:
        return self.js(_MESSAGES_JS)

    def status(self) -> dict[str, str]:
        return self.js(_STATUS_JS)


@pytest.fixture
def page(browser: Any, fake_server: Server) -> Iterator[Page]:
    wait_for(lambda: health(fake_server.url) == 200, 60, "a healthy server")
    yield Page(browser, fake_server)


def sessions_active(server: Server) -> float:
    return metric(server.get("/metrics").text, "trio_infer_sessions_active")


def chat(server: Server, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
    """What the server answers the same request without the page (not streamed)."""
    return server.post("/v1/chat/completions", {"model": server.model, "messages": messages, **params}).json()


def test_the_page_asks_for_the_api_key_and_sends_it(page: Page) -> None:
    page.driver.get(page.server.url + "/")
    page.js("sessionStorage.clear()")
    page.driver.refresh()
    wait_for(page.key_asked, 10, "the key dialog")
    reason = page.js("return document.getElementById('key-reason').textContent")
    assert reason == "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
    wait_for(lambda: page.status()["health"] == "API key needed", 3, "the status strip to say why")
    page.give_key("wrong")
    wait_for(page.key_asked, 5, "the key dialog again")
    assert not page.model_shown()
    page.give_key(KEY)
    wait_for(page.model_shown, 5, "the model id")
    wait_for(lambda: page.status()["health"] == "healthy", 3, "the status strip")
    # The model id is a string from the server, markup and all: it shows as text.
    assert page.js("return document.getElementById('model').childElementCount") == 0
    assert page.js("return window.injected") is None


def test_a_reply_streams_in_and_the_next_turn_carries_the_conversation(page: Page) -> None:
    page.open()
    system = "You answer in noise."
    page.set("system", system)
    page.set("temperature", "0")
    page.set("max-tokens", "40")
    page.js(_OBSERVE_JS)
    page.send("hello there")
    user, reply = page.messages()
    assert (user["kind"], user["text"]) == ("user", "hello there")
    assert reply["kind"] == "assistant" and reply["role"] == MARKUP_MODEL and reply["elements"] == 0
    assert (reply["finish"], reply["completion_tokens"]) == ("length", 40)
    lengths = page.js("return window.replyLengths")
    assert lengths == sorted(lengths)
    assert len(set(lengths) - {0}) >= 5, f"the text did not stream in: {lengths}"
    # Exactly the model's text (noise with '<', '&', odd bytes: shown as is, never as markup).
    first_turn = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    expected = chat(page.server, first_turn, temperature=0, max_tokens=40)
    assert reply["text"] == expected["choices"][0]["message"]["content"]
    assert reply["prompt_tokens"] == expected["usage"]["prompt_tokens"]

    page.send("and once more")
    *_, second = page.messages()
    assert second["kind"] == "assistant" and second["text"]
    # The second request held the whole conversation: its prompt is exactly these messages.
    history = [*first_turn, {"role": "assistant", "content": reply["text"]},
               {"role": "user", "content": "and once more"}]
    count = page.server.post("/tokenize", {"model": page.server.model, "messages": history}).json()["count"]
    assert second["prompt_tokens"] == count > reply["prompt_tokens"] + 40


def test_stop_ends_the_generation_and_the_server_frees_the_request(page: Page) -> None:
    page.open()
    page.set("max-tokens", "3000")  # a minute at 20 ms a step
    page.send("go on and on", wait=False)
    wait_for(lambda: len(page.messages()[-1]["text"]) > 20, 10, "the reply to start")
    assert sessions_active(page.server) == 1
    page.driver.find_element("id", "stop").click()
    took = wait_for(lambda: sessions_active(page.server) == 0, 1.0, "trio_infer_sessions_active 0")
    page.wait_idle(2)
    *_, user, reply = page.messages()
    assert reply["kind"] == "assistant" and reply["finish"] == "stopped" and "stopped" in reply["meta"]
    assert not user["excluded"] and not reply["excluded"]  # the partial reply stays in the history
    time.sleep(0.2)
    assert page.messages()[-1]["text"] == reply["text"]  # nothing more arrives
    status = page.server.get("/v1/status").json()
    assert status["requests"] == {"running": 0, "waiting": 0, "sessions": 0}, (status, took)


def test_server_errors_show_the_servers_message_as_text(page: Page) -> None:
    page.open()
    page.set("temperature", "0")
    page.set("max-tokens", "100000")
    page.send("this cannot fit")
    *_, user, error = page.messages()
    expected = chat(page.server, [{"role": "user", "content": "this cannot fit"}],
                    temperature=0, max_tokens=100000)["error"]["message"]
    assert error["kind"] == "error" and error["text"] == expected
    assert expected.startswith("This model's maximum context length is")
    assert user["excluded"]  # a failed turn is not sent again

    # An error message with markup in it (the server names the unknown field it was sent).
    field = '<script>window.injected = 3</script><img src=x onerror="window.injected = 4">'
    page.set("max-tokens", "5")
    page.set("extra", json.dumps({field: 1}))
    page.send("markup")
    *_, error = page.messages()
    assert error["kind"] == "error"
    assert error["text"] == f"Unrecognized request argument supplied: {field}"
    assert page.js("return document.querySelectorAll('#messages script, #messages img').length") == 0
    assert page.js("return window.injected") is None

    # A turn that works after the failures sends neither of them.
    page.set("extra", "")
    page.send("fine now")
    *_, reply = page.messages()
    assert reply["kind"] == "assistant" and reply["completion_tokens"] == 5
    only = page.server.post("/tokenize", {"model": page.server.model,
                                          "messages": [{"role": "user", "content": "fine now"}]})
    assert reply["prompt_tokens"] == only.json()["count"]


def test_the_status_strip_moves_during_a_generation_and_settles_after(page: Page) -> None:
    page.open()
    wait_for(lambda: page.status()["health"] == "healthy" and page.status()["running"] == "0",
             5, "an idle status strip")
    page.set("max-tokens", "150")  # 3 s at 20 ms a step
    page.send("keep going", wait=False)
    seen = []
    while page.busy():
        seen.append(page.status())
        time.sleep(0.1)
    assert page.messages()[-1]["completion_tokens"] == 150
    moving = [s for s in seen if s["running"] == "1" and float(s["tps"]) > 20 and int(s["kv_used"]) > 0]
    assert moving, seen
    ys = [float(p.split(",")[1]) for p in moving[-1]["spark"].split()]
    assert min(ys) < 12, moving[-1]["spark"]  # the sparkline rose
    assert moving[-1]["kv_total"] == str(page.server.get("/v1/status").json()["kv_pages"]["total"])

    def settled() -> bool:
        s = page.status()
        return (s["running"], s["waiting"], s["tps"]) == ("0", "0", "0.0") and s["kv_used"] == s["kv_cached"]

    took = wait_for(settled, 3.5, "the status strip to settle")
    assert took < 3.5


def _layout_problems(page: Page) -> list[str]:
    return page.js("""
      const problems = [];
      const w = window.innerWidth, h = window.innerHeight;
      if (document.documentElement.scrollWidth > w) problems.push('scrolls sideways');
      for (const id of ['model', 'status', 'input', 'composer', 'settings']) {
        const r = document.getElementById(id).getBoundingClientRect();
        if (r.width === 0 || r.left < 0 || r.right > w || r.top < 0 || r.bottom > h) {
          problems.push(`#${id} is not on the screen`);
        }
      }
      return problems;
    """)


def test_layout_on_a_laptop_and_a_phone(page: Page, tmp_path: Path) -> None:
    """Both widths hold the whole page without sideways scrolling; screenshots at a conversation
    (docs/chat-page.png is retaken from the laptop one with TRIO_INFER_DOCS_SCREENSHOT=1)."""
    docs = os.environ.get("TRIO_INFER_DOCS_SCREENSHOT") == "1"
    server, own = page.server, None
    default_model = Settings().cache_dir / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if docs and default_model.exists():
        server = own = start_server(Settings().cache_dir)
    try:
        shown = Page(page.driver, server)
        for name, width, height in [("laptop", 1280, 800), ("phone", 390, 844)]:
            page.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})
            shown.open()
            assert _layout_problems(shown) == [], name
            if name == "laptop":
                shown.set("temperature", "0")
                shown.set("max-tokens", "64")
                shown.send("What is the capital of France?", wait=docs)
                if docs:
                    shown.send("Write a short poem about it.", wait=False)
                    shown.wait_idle(120)
                    time.sleep(1.2)  # the strip after the replies, the sparkline still showing them
                else:
                    wait_for(lambda: len(shown.messages()[-1]["text"]) > 40, 10, "some reply text")
            else:
                shown.send("Hello from a phone", wait=False)
                wait_for(lambda: len(shown.messages()[-1]["text"]) > 40, 10, "some reply text")
            assert _layout_problems(shown) == [], name
            page.driver.save_screenshot(str(tmp_path / f"chat-page-{name}.png"))
            if docs and name == "laptop":
                page.driver.save_screenshot(str(DOCS_SCREENSHOT))
            if shown.busy():
                page.driver.find_element("id", "stop").click()
                shown.wait_idle(2)
    finally:
        page.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        if own is not None:
            stop_server(own)


def test_an_error_inside_the_stream_shows_its_message(page: Page) -> None:
    page.open()
    page.set("max-tokens", "3000")
    page.send("until the worker dies", wait=False)
    wait_for(lambda: len(page.messages()[-1]["text"]) > 10, 10, "the reply to start")
    [worker] = children(page.server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    page.wait_idle(5)
    *_, user, partial, error = page.messages()
    assert (error["kind"], error["text"]) == ("error", "the batching worker stopped; retry shortly")
    assert partial["kind"] == "assistant" and partial["text"] and partial["excluded"] and user["excluded"]
    # (Last in the module: nothing waits for the restarted worker but the next test's page fixture.)
