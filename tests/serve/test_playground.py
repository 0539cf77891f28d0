"""The playground page (`specdec serve` at /) in a real headless browser: Debian's Chromium,
driven by selenium through Debian's chromedriver, against a server on mock models.

The browser loads the page, sends a request, and the test reads what a person would see: tokens
coloured by origin (as many as the completion's tokens, their text the answer's), the stats,
one bar per round, acceptance by position, then both speeds side by side. With an API key set
the page asks for it and works once it is given. Needs `apt-get install -y chromium
chromium-driver` and selenium (requirements.txt); without them the tests skip, except under CI
(CI set), where a missing browser is a failure, not a skip.

`python tests/serve/test_playground.py docs/playground.png` makes docs/playground.md's screenshot
the same way, on the real qwen2.5-coder-0.5b (an edit, with the file as its prediction).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serverkit import MOCK_SPEC, FakeTokenizer, Server, SlowMock, V
from stream_golden import TemplateTokenizer

from specdec.serve import playground
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
#: The flags that work here (no sandbox as root, nothing fetched from the network).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
)
KEY = "playground-key"
WAIT_S = 60


def _missing() -> str | None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium (pip install -r requirements.txt)"
    return None


def browser(user_data_dir: str) -> Any:
    """A headless Chromium under selenium, with a fresh profile in `user_data_dir`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}"):
        opts.add_argument(flag)
    # the driver's path is given, so selenium's own driver manager never downloads one
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    missing = _missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the playground tests need {missing}")
        pytest.skip(f"needs {missing}")
    with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
        d = browser(profile)
        try:
            yield d
        finally:
            d.quit()


def _server(api_key: str | None = None) -> Server:
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.delay = 0.003  # a few ms a pass, so that a stream takes a moment, as a real one does
    target.tokenizer = TemplateTokenizer()
    draft = SlowMock.near(target, noise=0.7, seed=1)
    draft.tokenizer = target.tokenizer
    engine = Engine(target, draft, ServeConfig(target=MOCK_SPEC, k=4, draft_pool="off"))
    engine.warm_up()
    return Server(engine, ServeConfig(target=MOCK_SPEC, api_key=api_key))


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = _server()
    yield s
    s.close()


def page_url(srv: Server) -> str:
    return f"http://127.0.0.1:{srv.port}/"


def wait_state(d: Any, *states: str, timeout: float = WAIT_S) -> str:
    """Wait until the page says (body[data-state]) it is in one of `states`."""
    from selenium.webdriver.support.ui import WebDriverWait

    def reached(drv: Any) -> str | bool:
        state = drv.find_element("tag name", "body").get_attribute("data-state")
        return state if state in states else False

    try:
        return WebDriverWait(d, timeout).until(reached)
    except Exception:
        status = d.find_element("id", "status").text
        raise AssertionError(f"page never reached {states}; status: {status!r}") from None


def fill(d: Any, element_id: str, text: str) -> None:
    el = d.find_element("id", element_id)
    el.clear()
    el.send_keys(text)


def choose(d: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(d.find_element("id", element_id)).select_by_value(value)


def send(d: Any, message: str) -> None:
    fill(d, "message", message)
    d.find_element("id", "send").click()


def number(d: Any, element_id: str) -> float:
    text = d.find_element("id", element_id).text
    m = re.match(r"[-+]?\d+(\.\d+)?", text)
    assert m, f"#{element_id} shows {text!r}, not a number"
    return float(m.group())


def last_usage(d: Any) -> dict[str, Any]:
    text = d.execute_script("return document.getElementById('usage').textContent")
    return json.loads(text)


# ---------------------------------------------------------------------------- the page itself
def test_page_and_assets_are_served_from_the_package_with_a_strict_policy(srv: Server) -> None:
    for path, (name, media_type) in playground.FILES.items():
        status, headers, body = srv.request("GET", path)
        assert status == 200 and headers["content-type"] == media_type
        assert "script-src 'self'" in headers["content-security-policy"]
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        text = playground.read(name).decode()
        assert body == text
        # no CDN, nothing from anywhere else: it works offline
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), name


def test_the_page_streams_coloured_tokens_and_the_stats(driver: Any, srv: Server) -> None:
    driver.get(page_url(srv))
    wait_state(driver, "ready")
    assert MOCK_SPEC in driver.find_element("id", "model").text
    drafters = [
        o.get_attribute("value") for o in driver.find_elements("css selector", "#drafter option")
    ]
    assert drafters == ["", "none", "lookup", "prediction", "model", "composite"]
    fill(driver, "max-tokens", "40")
    send(driver, "abcabcabc: say something")
    wait_state(driver, "done", "error")
    assert driver.find_element("tag name", "body").get_attribute("data-state") == "done", (
        driver.find_element("id", "status").text
    )
    usage = last_usage(driver)
    spec = usage["speculation"]
    answer = driver.find_elements("css selector", "#conversation .answer")[-1]
    tokens = answer.find_elements("css selector", ".tok")
    assert len(tokens) == usage["completion_tokens"] == 40
    accepted = answer.find_elements("css selector", ".tok.accepted.src-model")
    assert len(accepted) > 0
    ends = answer.find_elements("css selector", ".tok.corrected, .tok.bonus")
    plain = answer.find_elements("css selector", ".tok.target")
    assert len(accepted) + len(ends) + len(plain) == 40
    # rounds that drafted nothing (the last token of the budget is one) give one target token
    assert len(plain) == spec["k_histogram"].get("0", 0)
    assert "".join(t.text for t in tokens) == answer.text
    for el in (accepted[0], ends[0]):  # coloured: the stylesheet applied, per origin
        assert el.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "")
    colours = {el.value_of_css_property("background-color") for el in (accepted[0], ends[0])}
    assert len(colours) == 2
    assert "round 1, K = 4" in tokens[0].get_attribute("title")
    assert number(driver, "stat-tps") > 0
    assert int(number(driver, "stat-tokens")) == 40
    assert int(number(driver, "stat-rounds")) == spec["rounds"]
    assert number(driver, "stat-mal") == pytest.approx(spec["mean_acceptance_length"], abs=0.01)
    assert (
        f"{spec['accepted']} / {spec['drafted']}" in driver.find_element("id", "stat-accept").text
    )
    assert len(driver.find_elements("css selector", "#rounds .bar")) == spec["rounds"]
    bars = driver.find_elements("css selector", "#positions .bar")
    assert len(bars) == len(spec["drafted_per_position"]) == 4

    driver.find_element("id", "compare").click()
    wait_state(driver, "compared", "error")
    assert driver.find_element("id", "compare-box").is_displayed()
    assert number(driver, "cmp-spec-tps") > 0 and number(driver, "cmp-base-tps") > 0
    assert int(number(driver, "cmp-base-tokens")) == 40
    # greedy on a batch-invariant target: the answer without speculation is the same
    assert "the same answer" in driver.find_element("id", "cmp-verdict").text


def test_the_page_steers_speculation_and_shows_a_refusal(driver: Any, srv: Server) -> None:
    driver.get(page_url(srv))
    wait_state(driver, "ready")
    choose(driver, "drafter", "none")
    fill(driver, "max-tokens", "12")
    send(driver, "hello")
    wait_state(driver, "done")
    answer = driver.find_elements("css selector", "#conversation .answer")[-1]
    assert len(answer.find_elements("css selector", ".tok.target")) == 12
    assert last_usage(driver)["speculation"]["drafter"] == "none"
    assert driver.find_element("id", "stat-accept").text == "no drafts"

    choose(driver, "drafter", "lookup")
    choose(driver, "k-mode", "fixed")
    fill(driver, "k-value", "0")  # below the form's min: the server's 400 is shown
    send(driver, "hello again")
    wait_state(driver, "error")
    status = driver.find_element("id", "status").text
    assert "speculation.k must be" in status and "[1, 128]" in status
    fill(driver, "k-value", "2")
    send(driver, "hello again, abcabc abcabc")
    wait_state(driver, "done")
    spec = last_usage(driver)["speculation"]
    assert spec["drafter"] == "lookup" and spec["k"] == 2
    assert set(spec["k_histogram"]) <= {"0", "1", "2"}


def test_a_model_without_a_chat_template_is_served_through_completions(driver: Any) -> None:
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = FakeTokenizer()  # reads text, has no chat template
    engine = Engine(target, None, ServeConfig(target=MOCK_SPEC, drafter="lookup", draft_pool="off"))
    engine.warm_up()
    srv = Server(engine, ServeConfig(target=MOCK_SPEC))
    try:
        driver.get(page_url(srv))
        wait_state(driver, "ready")
        fill(driver, "max-tokens", "10")
        send(driver, "0123401234")
        wait_state(driver, "error")
        assert "no chat template" in driver.find_element("id", "status").text
        assert driver.find_element("id", "api").get_attribute("value") == "completions"
        driver.find_element("id", "send").click()
        wait_state(driver, "done")
        usage = last_usage(driver)
        assert usage["completion_tokens"] == 10 and usage["speculation"]["drafter"] == "lookup"
        answer = driver.find_elements("css selector", "#conversation .answer")[-1]
        assert len(answer.find_elements("css selector", ".tok")) == 10
    finally:
        srv.close()


def test_with_an_api_key_the_page_asks_for_it(driver: Any) -> None:
    srv = _server(api_key=KEY)
    try:
        driver.get(page_url(srv))
        driver.execute_script("sessionStorage.clear()")
        driver.get(page_url(srv))
        wait_state(driver, "locked")
        assert driver.find_element("id", "key-row").is_displayed()
        assert driver.find_element("id", "send").get_attribute("disabled") is not None
        fill(driver, "api-key", "wrong")
        driver.find_element("id", "key-save").click()
        wait_state(driver, "locked")
        fill(driver, "api-key", KEY)
        driver.find_element("id", "key-save").click()
        wait_state(driver, "ready")
        assert not driver.find_element("id", "key-row").is_displayed()
        fill(driver, "max-tokens", "8")
        send(driver, "hi")
        wait_state(driver, "done")
        assert last_usage(driver)["completion_tokens"] == 8
    finally:
        driver.execute_script("sessionStorage.clear()")
        srv.close()


# ---------------------------------------------------------------------------- the screenshot
SCREENSHOT_FILE = '''def lru_cache(size):
    """A least-recently-used cache of at most `size` entries."""
    entries = {}
    order = []

    def get(key):
        if key in entries:
            order.remove(key)
            order.append(key)
            return entries[key]
        return None

    def put(key, value):
        if len(entries) >= size:
            oldest = order.pop(0)
            del entries[oldest]
        entries[key] = value
        order.append(key)

    return get, put
'''


def make_screenshot(out: Path, target: str = "llamacpp:qwen2.5-coder-0.5b") -> None:
    """docs/playground.md's screenshot: `target` behind `specdec serve --drafter prediction`
    (K = auto), an edit request with the file as its prediction, then the same without
    speculation."""
    from specdec.serve.launch import build_engine

    cfg = ServeConfig(target=target, drafter="prediction", threads=1)
    srv = Server(build_engine(cfg), cfg)
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
            d = browser(profile)
            try:
                d.get(page_url(srv))
                wait_state(d, "ready")
                fill(d, "max-tokens", "200")
                d.find_element("css selector", "#prediction-box summary").click()
                fill(d, "prediction", SCREENSHOT_FILE)
                send(d, "Rename `entries` to `store` in this code:\n\n" + SCREENSHOT_FILE)
                wait_state(d, "done", timeout=300)
                d.find_element("id", "compare").click()
                wait_state(d, "compared", timeout=300)
                # the whole page: a viewport as tall as the document
                height = d.execute_script("return document.documentElement.scrollHeight")
                metrics = {"width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False}
                d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
                d.save_screenshot(str(out))
            finally:
                d.quit()
    finally:
        srv.close()


if __name__ == "__main__":
    make_screenshot(
        Path(sys.argv[1] if len(sys.argv) > 1 else "docs/playground.png"), *sys.argv[2:]
    )
