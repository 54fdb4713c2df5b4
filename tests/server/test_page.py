"""The page at ``/`` (server/page.py, server/static/) and its ``/stats`` JSON.

The HTTP tests always run. The browser tests drive Debian's headless Chromium through
selenium and the distribution's chromedriver (no browser or driver is downloaded); they
skip, saying why, where either is absent (``make setup`` installs both where apt-get and
root are available)."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.server.conftest import API_KEY
from tests.server.http_util import get, metrics, post

PROMPT = "def add(a, b):"


def _complete(port: int, **body) -> dict:
    status, _, data = post(port, "/v1/completions", dict({"prompt": PROMPT, "temperature": 0}, **body))
    assert status == 200, data
    return json.loads(data)


# --- HTTP --------------------------------------------------------------------------------


def test_index_is_public_with_api_key(keyed_server):
    """With --api-key the page, its files and /stats load without a key; /v1 still needs one."""
    port = keyed_server.port
    status, headers, body = get(port, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<script src="static/page.js">' in body
    status, headers, js = get(port, "/static/page.js")
    assert status == 200 and "javascript" in headers["Content-Type"] and b"v1/completions" in js
    status, headers, _ = get(port, "/static/page.css")
    assert status == 200 and headers["Content-Type"].startswith("text/css")
    assert get(port, "/stats")[0] == 200
    assert get(port, "/v1/models")[0] == 401


@pytest.mark.timeout(120)
def test_page_files_do_not_hold_up_the_shutdown_drain(engine):
    """The page's files are file responses (send_file); they must stop counting as in
    flight once served, or a SIGTERM drain waits its whole --shutdown-timeout for them."""
    from types import SimpleNamespace

    from server import BackgroundServer, create_app
    from server.page import STATIC_DIR

    app = create_app(engine, SimpleNamespace(served_model_name=["m"]))
    srv = BackgroundServer(app, port=0, shutdown_timeout=60).start()
    try:
        for path, name in (("/", "index.html"), ("/static/page.js", "page.js"), ("/static/page.css", "page.css")):
            status, _, body = get(srv.port, path)
            assert status == 200 and body == (STATIC_DIR / name).read_bytes(), path
    finally:
        t0 = time.monotonic()
        srv.stop()
    assert time.monotonic() - t0 < 30, "the drain waited for requests that had been served"


def test_static_files_stay_in_their_folder(server):
    for path in ("/static/../page.py", "/static/..%2Fpage.py", "/static/nope.js"):
        status, _, body = get(server.port, path)
        assert status == 404, (path, body[:200])


def test_stats_is_metrics_as_json(server, engine):
    """/stats carries the same figures as /metrics: after a completion the token counters
    moved by its usage, and both endpoints agree."""
    before = json.loads(get(server.port, "/stats")[2])
    usage = _complete(server.port, max_tokens=12)["usage"]
    status, headers, data = get(server.port, "/stats")
    assert status == 200 and headers["Content-Type"] == "application/json"
    after = json.loads(data)
    m = metrics(server.port)
    assert after["generation_tokens"] - before["generation_tokens"] == usage["completion_tokens"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == usage["prompt_tokens"]
    assert after["num_requests_finished"] == before["num_requests_finished"] + 1
    assert after["timestamp"] > before["timestamp"]
    for key, name in (("generation_tokens", "vllm:generation_tokens_total"),
                      ("prompt_tokens", "vllm:prompt_tokens_total"),
                      ("num_requests_finished", "vllm:request_success_total"),
                      ("num_gpu_blocks", "vllm:num_gpu_blocks")):
        assert after[key] == m[name], key
    assert after["num_gpu_blocks"] == engine.get_stats().num_gpu_blocks > 0
    assert 0.0 <= after["kv_cache_usage"] <= 1.0
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    assert after["model_name"] == "tiny-llama" and after["engine_alive"] is True
    assert isinstance(after["num_free_blocks"], int) and isinstance(after["kv_cache_usage"], float)


# --- headless Chromium -------------------------------------------------------------------

_CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   "--no-proxy-server", "--disable-dev-shm-usage", "--window-size=1280,900")
_WAIT_S = 60.0  # generous: the CI box is a loaded 2-core machine


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver; "
                    "`make setup` does it where apt-get and root are available)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in _CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    # the driver's path is given, so selenium runs no driver manager (nothing is downloaded)
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    drv.set_script_timeout(_WAIT_S)
    yield drv
    drv.quit()


def _wait(drv, cond, what: str, timeout: float = _WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout, poll_frequency=0.1).until(lambda d: cond(d), message=what)


def _value(drv, element_id: str) -> float:
    v = drv.find_element("id", element_id).get_attribute("data-value")
    return float(v) if v else float("nan")


def _open(drv, srv) -> None:
    drv.get(srv.base_url + "/")
    assert drv.title == "vengine"
    # the panel filled itself from /stats
    _wait(drv, lambda d: d.find_element("id", "stat-running").get_attribute("data-value"), "panel never filled")


def _set(drv, element_id: str, text: str) -> None:
    el = drv.find_element("id", element_id)
    el.clear()
    el.send_keys(text)


def _finished_status(drv, element_id: str) -> str:
    """Wait for a box's status line to leave "streaming"; return it, failing on an error."""
    el = drv.find_element("id", element_id)
    _wait(drv, lambda d: "busy" not in el.get_attribute("class") and el.text, f"{element_id} never finished")
    assert "error" not in el.get_attribute("class"), el.text
    return el.text


def test_page_streams_completion_and_shows_stats(server, browser):
    expected = _complete(server.port, max_tokens=48)["choices"][0]["text"]
    assert expected
    _open(browser, server)
    before = _value(browser, "stat-finished")
    _set(browser, "prompt", PROMPT)
    _set(browser, "max-tokens", "48")
    _set(browser, "temperature", "0")
    # count the separate DOM updates of the generated text: tokens show up as they arrive
    browser.execute_script("""
        window.__updates = 0;
        new MutationObserver(() => window.__updates++).observe(
            document.getElementById('completion-output'), {subtree: true, childList: true, characterData: true});""")
    browser.find_element("id", "complete-btn").click()
    status = _finished_status(browser, "completion-status")
    generated = browser.find_element("id", "completion-generated").get_attribute("textContent")
    assert generated == expected  # every streamed chunk landed once, in order
    assert "tokens in" in status and "tokens/s" in status, status
    assert browser.execute_script("return window.__updates") > 2
    # the panel saw the completion: a positive generation rate and one more finished request
    _wait(browser, lambda d: _value(d, "stat-tps") > 0, "tokens/s stayed 0", timeout=8.0)
    _wait(browser, lambda d: _value(d, "stat-finished") >= before + 1, "finished count did not move")
    assert _value(browser, "stat-running") >= 0 and _value(browser, "stat-waiting") >= 0
    assert 0 <= _value(browser, "stat-kv") <= 1
    assert _value(browser, "stat-blocks") > 0
    assert browser.find_element("id", "stat-state").text == "live"


def test_page_chat_streams(server, browser):
    messages = [{"role": "user", "content": "Write a loop."}]
    status, _, data = post(server.port, "/v1/chat/completions",
                           {"messages": messages, "max_tokens": 24, "temperature": 0})
    assert status == 200, data
    expected = json.loads(data)["choices"][0]["message"]["content"]
    _open(browser, server)
    browser.find_element("id", "tab-chat").click()
    assert browser.find_element("id", "chat-panel").is_displayed()
    assert not browser.find_element("id", "completion-panel").is_displayed()
    _set(browser, "max-tokens", "24")
    _set(browser, "temperature", "0")
    _set(browser, "chat-input", messages[0]["content"])
    browser.find_element("id", "chat-send").click()
    _finished_status(browser, "chat-status")
    bubbles = browser.find_elements("css selector", "#chat-log .msg")
    assert [b.get_attribute("class") for b in bubbles] == ["msg user", "msg assistant"]
    assert bubbles[0].text == messages[0]["content"]
    assert bubbles[1].get_attribute("textContent") == expected


def test_page_sends_pasted_api_key(keyed_server, browser):
    """The page loads without the key; a completion without it shows the 401, then the
    pasted key goes out as a bearer header and the completion streams."""
    _open(browser, keyed_server)
    browser.execute_script("sessionStorage.clear()")
    _set(browser, "api-key", "")
    _set(browser, "prompt", PROMPT)
    _set(browser, "max-tokens", "8")
    browser.find_element("id", "complete-btn").click()
    status = browser.find_element("id", "completion-status")
    _wait(browser, lambda d: "error" in status.get_attribute("class"), "no error without the key")
    assert "HTTP 401" in status.text and "API key" in status.text
    _set(browser, "api-key", API_KEY)
    browser.find_element("id", "complete-btn").click()
    _finished_status(browser, "completion-status")
    assert browser.find_element("id", "completion-generated").get_attribute("textContent")


def _aborted_requests(port: int) -> float:
    _, _, data = get(port, "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in data.decode().splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)


def test_page_stop_aborts_the_request(server, browser):
    """Stop cancels the fetch; the server sees the disconnect and aborts the engine request,
    which frees its KV blocks."""
    _open(browser, server)
    aborted = _aborted_requests(server.port)
    _set(browser, "prompt", PROMPT)
    _set(browser, "max-tokens", "400")  # far more than arrives before the first chunk
    # click Stop from inside the page as soon as the first text shows (no round-trip delay)
    browser.execute_script("""
        const out = document.getElementById('completion-output');
        const obs = new MutationObserver(() => {
            const gen = document.getElementById('completion-generated');
            if (gen && gen.textContent) { obs.disconnect(); document.getElementById('complete-stop').click(); }
        });
        obs.observe(out, {subtree: true, childList: true, characterData: true});""")
    browser.find_element("id", "complete-btn").click()
    status = browser.find_element("id", "completion-status")
    _wait(browser, lambda d: "busy" not in status.get_attribute("class") and status.text, "never stopped")
    assert status.text == "stopped"
    assert browser.find_element("id", "complete-btn").is_enabled()
    assert not browser.find_element("id", "complete-stop").is_enabled()
    _wait(browser, lambda d: _aborted_requests(server.port) == aborted + 1, "the engine request was not aborted")

    def idle(_):
        s = json.loads(get(server.port, "/stats")[2])
        return s["num_requests_running"] == 0 and s["num_free_blocks"] == s["num_gpu_blocks"]
    _wait(browser, idle, "KV blocks not freed after the abort")
