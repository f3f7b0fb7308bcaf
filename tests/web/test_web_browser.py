"""End to end in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium) on ``fdq web`` in its own process, over a real
database with real producers and consumer processes (``tests/workers`` role ``web-consumer``, killed by PID).

Screenshots of the main views are written to ``$FDQ_WEB_SCREENSHOTS`` if set, else to a
``screenshots`` folder under pytest's temporary directory (its path is printed). Without
Chromium, its driver or Selenium, every test here skips, saying which is missing (``make
test`` installs Chromium where it can: see the Makefile's ``browser`` step)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

import fdq

from fdqtest import kill_all, read_lines, wait_for
from webhelpers import TOKEN, start_web

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# As this machine's notes say: no GPU, no sandbox as root, and none of Chromium's own
# network traffic (the network here is closed: it would log refused connections).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000"]


def _missing() -> str | None:
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return (f"no {path}: Debian's {package} is not installed (as root: apt-get install -y "
                    "chromium chromium-driver; make test does it where apt-get runs as root)")
    return None


@pytest.fixture(scope="module")
def driver():
    why = _missing()
    if why:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="fdq-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    d.set_page_load_timeout(60)
    d.set_script_timeout(30)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = Path(os.environ.get("FDQ_WEB_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the dashboard: {folder}")
    return folder


class Page:
    """The dashboard in the browser. Reads go through one script each (the page
    re-renders every poll, so an element found a moment ago may be gone); every wait is
    bounded and waits for a condition."""

    def __init__(self, driver, base: str, shots: Path):
        self.d, self.base, self.shots = driver, base, shots

    def open(self, fragment: str = ""):
        self.d.get(self.base + fragment)
        self.wait(lambda: (self.js("return document.querySelector('#live').textContent") or "").startswith("live"),
                  30, "the page's first refresh")

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def wait(self, cond, timeout: float = 60, what: str = "the page to show it"):
        from selenium.common.exceptions import StaleElementReferenceException

        def safe():
            try:
                return cond()
            except StaleElementReferenceException:
                return None
        return wait_for(safe, timeout, what)

    def attr(self, css: str, name: str):
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null",
                       css, name)

    def text(self, css: str):
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.textContent.trim() : null", css)

    def click(self, css: str):
        """A real click (WebDriver's), found again if the element was re-rendered."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        def clicked():
            try:
                found = self.d.find_elements(By.CSS_SELECTOR, css)
                if not found:
                    return False
                found[0].click()
                return True
            except StaleElementReferenceException:
                return False
        self.wait(clicked, 15, f"{css} to click")

    def confirm(self):
        self.wait(lambda: self.js("return document.querySelector('#confirm').open"), 10, "the confirmation dialog")
        self.click("#confirm-ok")

    def toast(self, kind: str, contains: str, timeout: float = 60) -> str:
        def shown():
            t = self.js("const t = document.querySelector('#toast');"
                        "return t.hidden ? null : [t.dataset.kind, t.textContent]")
            return t[1] if t and t[0] == kind and contains in t[1] else None
        return self.wait(shown, timeout, f"a {kind} message saying {contains!r}")

    def use_token(self, token: str):
        from selenium.webdriver.common.by import By
        box = self.d.find_element(By.CSS_SELECTOR, "#token")
        box.send_keys(token)
        self.click("#token-save")
        self.wait(lambda: self.text("#access") == "token set", 10, "the token taken")

    def chart(self, name: str) -> dict:
        raw = self.attr(f"#chart-{name}", "data-last")
        return json.loads(raw) if raw else {}

    def owners(self, sub: str = "default") -> list:
        return self.js("return [...document.querySelectorAll('.shard[data-sub=\"' + arguments[0] + '\"]')]"
                       ".map(e => e.dataset.owner)", sub)

    def consumer_state(self, cid: str):
        return self.attr(f'#consumers-table tr[data-consumer="{cid}"]', "data-state")

    def console_problems(self) -> list:
        return [e for e in self.d.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]

    def shot(self, name: str) -> Path:
        """The whole page (the window stretched to its height), as ``name``.png."""
        size = self.d.get_window_size()
        height = self.js("return document.documentElement.scrollHeight")
        self.d.set_window_size(size["width"], max(size["height"], min(height, 4000)))
        try:
            self.js("for (const c of Object.values(state.charts)) c.draw()")
            path = self.shots / f"{name}.png"
            self.d.save_screenshot(str(path))
        finally:
            self.d.set_window_size(size["width"], size["height"])
        return path


@pytest.fixture
def web(db_url):
    """``fdq web`` (write token ``TOKEN``, sampling every 300 ms) on this test's database."""
    proc, base = start_web(db_url, "--write-token", TOKEN, "--sample-interval", "300ms")
    said = []       # its log, read as it comes: a pipe left full would block its writes, and its exit
    threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True).start()
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"fdq web did not stop within 30 s of SIGTERM; it logged {len(said)} lines, "
                             f"the last: {said[-10:]}") from None
    finally:
        kill_all([proc])


@pytest.fixture
def page(driver, web, shots):
    driver.get("about:blank")
    driver.get_log("browser")          # what an earlier test left
    return Page(driver, web, shots)


def test_the_page_loads_with_no_console_errors(page, db):
    fdq.Supervisor(db).create_topic("orders", shards=4)
    fdq.Supervisor(db).create_topic("audit", shards=2)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(5)])
    page.open()
    page.wait(lambda: page.text('#topics-table tr[data-topic="orders"] [data-field=backlog]') == "5", 30,
              "the topics table with orders' backlog")
    assert page.text('#topics-table tr[data-topic="audit"] [data-field=backlog]') == "0"
    page.shot("topics")
    page.click('#topics-table tr[data-topic="orders"] a')
    page.wait(lambda: page.chart("backlog").get("default") == 5, 60, "the backlog chart at 5")
    assert len(page.owners()) == 4
    assert page.console_problems() == []


def test_a_push_shows_up_in_the_live_backlog_chart(page, db):
    fdq.Supervisor(db).create_topic("orders", shards=4)
    page.open("#/topic/orders")
    page.wait(lambda: page.chart("backlog") == {"default": 0}, 60, "the backlog chart at 0")
    page.js("window.notReloaded = true")
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"x%d" % i, shard_key=f"k{i}") for i in range(7)])
    page.wait(lambda: page.chart("backlog").get("default") == 7, 60, "the pushes in the backlog chart")
    assert page.js("return window.notReloaded") is True, "the page reloaded"
    assert page.text('#subs-table tr[data-sub="default"] [data-field=backlog]') == "7"
    page.wait(lambda: (page.chart("rates").get("inserted/s") or 0) > 0 or
              int(page.attr("#chart-rates", "data-points") or 0) > 4, 30, "the rates chart drawn")
    page.shot("topic-backlog")
    assert page.console_problems() == []


def test_a_killed_consumer_shows_as_a_zombie_and_its_shards_move_to_the_survivor(page, db, workers):
    fdq.Supervisor(db).create_topic("orders", shards=8)
    fdq.Producer(db).push_many("orders", [fdq.Envelope(b"m%d" % i, shard_key=f"k{i}") for i in range(200)])
    # The survivor waits 6 s before taking a silent peer's shards; the victim's record says
    # it is a zombie after 1 s: the page has ~5 s to show it as one.
    victim = workers.start("web-consumer", "worker-a", "--topic", "orders", "--zombie", 1.0)
    workers.start("web-consumer", "worker-b", "--topic", "orders", "--zombie", 6.0)
    page.open("#/topic/orders")
    page.wait(lambda: set(page.owners()) == {"worker-a", "worker-b"} and
              page.consumer_state("worker-a") == page.consumer_state("worker-b") == "live", 60,
              "both consumers live, sharing the shards")
    page.shot("consumers")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)
    # one reading of the page: worker-a a zombie, and its four shards drawn as a zombie's
    page.wait(lambda: page.js("return [document.querySelector('#consumers-table tr[data-consumer=\"worker-a\"]')"
                              "?.dataset.state, document.querySelectorAll('.shard.zombie').length]") == ["zombie", 4],
              30, "worker-a shown as a zombie, with its 4 shards")
    page.shot("consumer-zombie")
    page.wait(lambda: page.owners() == ["worker-b"] * 8 and page.consumer_state("worker-a") is None, 60,
              "every shard owned by worker-b, worker-a gone")
    # the list of changes comes from the sampler, a sample behind the live figures at most
    page.wait(lambda: "worker-a → worker-b" in page.text("#events"), 60, "the takeover in the list of changes")
    assert "worker-a is a zombie" in page.text("#events")
    page.shot("shards-taken-over")
    assert page.console_problems() == []


def test_pausing_from_the_page_stops_deliveries_and_play_resumes_them(page, db, sup, workers):
    sup.create_topic("orders", shards=2)
    worker = workers.start("web-consumer", "worker-p", "--topic", "orders")
    p = fdq.Producer(db)
    p.push("orders", b"before")
    wait_for(lambda: "ack before" in read_lines(worker.out), 60, what="the first message delivered")
    page.open("#/topic/orders")
    page.use_token(TOKEN)
    page.click("#pause-topic")
    page.confirm()
    page.toast("ok", "paused topic 'orders'")
    page.wait(lambda: page.text("#topic-paused") == "paused", 60, "the topic shown paused")
    assert sup.config("orders").paused
    for i in range(3):
        p.push("orders", f"during-{i}".encode())
    page.wait(lambda: page.text('[data-setting="pending (paused)"] dd') == "3", 60, "3 pushes pending")
    # The consumer goes on running (its heartbeats move) and is handed nothing.
    beats = lambda: sup.stats("orders")["subscriptions"]["default"]["consumers"][0]["heartbeats"]  # noqa: E731
    first = beats()
    wait_for(lambda: beats() >= first + 3, 30, what="three more heartbeats of the consumer")
    assert not [line for line in read_lines(worker.out) if "during" in line]
    page.shot("topic-paused")
    page.click("#play-topic")
    page.confirm()
    page.toast("ok", "resumed topic 'orders' (3 pushed while paused routed)")
    wait_for(lambda: {f"ack during-{i}" for i in range(3)} <= set(read_lines(worker.out)), 60,
             what="the paused pushes delivered after play")


def test_a_dead_letter_redriven_from_the_page_is_delivered_again(page, db, sup, workers, tmp_path):
    sup.create_topic("orders", shards=2)
    cure = tmp_path / "cure"
    worker = workers.start("web-consumer", "worker-d", "--topic", "orders", "--max-deliver", 1, "--cure", cure)
    fdq.Producer(db).push("orders", b"poison-1", shard_key="cust-7")
    page.open("#/topic/orders")
    page.wait(lambda: page.text('#subs-table tr[data-sub="default"] [data-field=dlq]') == "1", 60,
              "the dead letter counted")
    page.click('#subs-table tr[data-sub="default"] [data-field=dlq] a')
    page.wait(lambda: page.js("return document.querySelectorAll('#dlq-table tbody tr[data-id]').length") == 1,
              30, "the dead letter listed")
    row = page.text("#dlq-table tbody tr[data-id]")
    assert "max_deliver (1)" in row and "poison-1" in row and "cust-7" in row, row
    page.shot("dead-letters")
    cure.touch()
    page.use_token(TOKEN)
    page.click("#dlq-table tbody tr[data-id] input[type=checkbox]")
    page.wait(lambda: page.text("#dlq-selected") == "1 selected", 10, "one dead letter selected")
    page.click("#dlq-redrive")
    page.confirm()
    page.toast("ok", "redrove 1 dead letter")
    wait_for(lambda: "ack poison-1" in read_lines(worker.out), 60, what="the redriven message handled")
    got = [line for line in read_lines(worker.out) if line.startswith("got poison-1")]
    assert len(got) == 2 and got[0].split()[3] == got[1].split()[3], got     # the same message, twice
    page.wait(lambda: page.text("#dlq-table tbody") == "No dead letters.", 60, "the dead-letter queue empty")


def test_actions_from_the_page_are_refused_without_the_token_and_rebalance_takes_a_shard_count(page, db, sup):
    sup.create_topic("orders", shards=4)
    page.open("#/topic/orders")
    page.click("#pause-topic")
    page.confirm()
    page.toast("error", "needs the write token")
    page.shot("refused-without-token")
    assert not sup.config("orders").paused
    page.use_token(TOKEN)
    page.js("document.querySelector('#rebalance-shards').value = '6'")
    page.click("#rebalance")
    page.wait(lambda: page.text("#confirm-text").startswith("Change orders to 6 shards"), 10, "the question")
    page.confirm()
    page.toast("ok", "rebalanced topic 'orders' to 6 shards")
    page.wait(lambda: len(page.owners()) == 6, 60, "six shards drawn")
    assert sup.config("orders").shards == 6
    page.js("document.querySelector('#rebalance-shards').value = '0'")
    page.click("#rebalance")
    page.confirm()
    page.toast("error", "shards must be an integer > 0, not 0")
