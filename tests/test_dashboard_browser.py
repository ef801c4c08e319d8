"""Acceptance: the dashboard in headless Chromium while a faulty run streams through Kafka.

Needs Debian's ``chromium`` and ``chromium-driver`` (scripts/setup.sh installs them) and
selenium. Skipped when they are missing, except in CI (``CI=true``), where that fails.
Screenshots go to ``artifacts/screenshots/``; the run page's also to
``docs/img/dashboard.png`` (the README's picture).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.chat_servers import FakeDingTalk
from tests.service_proc import ServiceProcess, publish_scenario
from trainsentry.simulate import Scenario, generate

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts" / "screenshots"
README_IMG = ROOT / "docs" / "img" / "dashboard.png"
CHROMIUM = os.environ.get("TRAINSENTRY_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TRAINSENTRY_CHROMEDRIVER", "/usr/bin/chromedriver")
RUN_ID = "browser/grpo-nan"


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        why = f"browser test needs {', '.join(missing)}; run scripts/setup.sh"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)


def _driver() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager go online
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,1500", "--hide-scrollbars", "--force-device-scale-factor=1",
                "--disable-extensions", "--no-first-run", "--lang=en-US"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


def _paced_publish(bootstrap: str, prefix: str, events: list[dict[str, Any]],
                   pace_s: float, stop: threading.Event) -> None:
    """Publish a run step by step (``pace_s`` apart), as a trainer would."""
    from producers import MetricsProducer

    chunks: list[list[dict[str, Any]]] = []
    step = None
    for ev in events:
        s = ev.get("step")
        if not chunks or (s is not None and s != step and "layer" in ev):
            chunks.append([])
            step = s
        chunks[-1].append(ev)
    with MetricsProducer(run_id=RUN_ID, bootstrap=bootstrap, topic_prefix=prefix) as p:
        for chunk in chunks:
            if stop.is_set():
                return
            publish_scenario(p, chunk)
            p.flush(5)
            time.sleep(pace_s)


def _shot(driver: Any, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def _small_png(src: Path, dst: Path, limit: int = 300_000) -> None:
    """Copy a screenshot for the README, palette-reduced when it is over ``limit`` bytes."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    if dst.stat().st_size <= limit:
        return
    from PIL import Image  # matplotlib's dependency, in the [service] extra

    with Image.open(src) as im:
        im.convert("RGB").quantize(colors=64).save(dst, optimize=True)


def _browser_flow(base: str, svc: ServiceProcess) -> dict[str, Any]:
    """Everything the browser does; blocking, so the test runs it in a thread."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = _driver()
    out: dict[str, Any] = {}
    try:
        wait = WebDriverWait(driver, 120, poll_frequency=0.5)
        driver.get(base + "/")
        wait.until(ec.visibility_of_element_located((By.ID, "runs")))
        row = f'tr[data-run-id="{RUN_ID}"]'
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, row)))
        out["first_status"] = driver.find_element(By.CSS_SELECTOR, row).get_attribute("data-status")
        # The fault starts mid-run: the row turns red with the right diagnosis, live.
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'{row}[data-status="red"]')))
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, f"{row} td.diagnosis"),
                                                    "nan_loss"))
        _shot(driver, "01-runs-red")

        driver.find_element(By.CSS_SELECTOR, f"{row} a.run-link").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR,
                                                   '#run-status[data-status="red"]')))
        wait.until(ec.text_to_be_present_in_element((By.ID, "run-diagnosis"), "nan_loss"))
        grad = 'figure.chart[data-key="actor/grad_norm"]'
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f"{grad} svg polyline")))
        wait.until(lambda d: int(d.find_element(By.CSS_SELECTOR, grad)
                                 .get_attribute("data-anomalies") or 0) > 0)
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#commands tr[data-kind]")))
        out["charts"] = len(driver.find_elements(By.CSS_SELECTOR, "figure.chart"))
        out["band"] = len(driver.find_elements(By.CSS_SELECTOR, "figure.chart svg rect.band"))
        out["nan_marks"] = len(driver.find_elements(By.CSS_SELECTOR, f"{grad} svg path.nan"))
        out["path"] = driver.current_url
        page = _shot(driver, "02-run-red")
        _small_png(page, README_IMG)

        card = '#alerts .alert[data-diagnosis="nan_loss"]'
        wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, f"{card} .silence-btn"))).click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "action-msg"), "Silenced nan_loss"))
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR,
                                                   "#silences li[data-silence-id]")))
        out["silence_id"] = driver.execute_script("return document.body.dataset.lastSilence")
        out["silence_msg"] = driver.find_element(By.ID, "action-msg").text

        # An ack needs the problem in the alert history, written once chat delivery settled.
        history = f"/api/runs/{RUN_ID}/history"
        wait.until(lambda _d: (svc.get(history)[1] or {}).get("history"))
        driver.find_element(By.CSS_SELECTOR, f"{card} .ack-btn").click()
        wait.until(lambda d: "cknowledge" in d.find_element(By.ID, "action-msg").text)
        out["ack_msg"] = driver.find_element(By.ID, "action-msg").text
        _shot(driver, "03-run-silenced")
        out["console"] = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    except Exception:
        _shot(driver, "99-failure")
        (SHOTS / "99-failure.html").write_text(driver.page_source)
        raise
    finally:
        driver.quit()
    return out


async def test_dashboard_shows_the_run_turn_red_and_silences_its_alert(
        kafka_bootstrap: str, topic_prefix: str, free_port: int,
        dingtalk_server: FakeDingTalk) -> None:
    """A NaN-loss run streams in: its row turns red with nan_loss, its page charts the
    grad norm with NaNs and band, and the Silence button creates a silence the service holds."""
    _need_browser()
    svc = ServiceProcess(bootstrap=kafka_bootstrap, prefix=topic_prefix, web_port=free_port,
                         control_secret="browser-secret", extra_env={
                             "TRAINSENTRY_DINGTALK_URL": dingtalk_server.url,
                             "TRAINSENTRY_DINGTALK_SECRET": dingtalk_server.secret or ""}).start()
    stop = threading.Event()
    publisher: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(svc.wait_ready)
        events = generate(Scenario(run_id=RUN_ID, steps=70, fault="nan_loss", fault_onset=40,
                                   ranks=2, save_freq=1000, seed=3, start_ts=time.time() - 1500))
        # No run_finished: the run stays live (and red) while the browser looks at it.
        events = [e for e in events if e.get("type") != "run_finished"]
        publisher = asyncio.create_task(asyncio.to_thread(
            _paced_publish, kafka_bootstrap, topic_prefix, events, 0.08, stop))
        result = await asyncio.to_thread(_browser_flow, f"http://127.0.0.1:{free_port}", svc)
        await publisher

        assert result["path"].endswith("/runs/" + RUN_ID)
        assert result["charts"] >= 4 and result["band"] >= 1 and result["nan_marks"] >= 1
        assert result["console"] == [], result["console"]
        # The silence took effect in the service: it holds it, active, for this run.
        status, body = await asyncio.to_thread(svc.get, "/api/silences")
        assert status == 200, body
        mine = [s for s in body["silences"] if s["id"] == result["silence_id"]]
        assert len(mine) == 1 and mine[0]["state"] == "active"
        labels = {(m["name"], m["value"]) for m in mine[0]["matchers"]}
        assert {("run_id", RUN_ID), ("diagnosis", "nan_loss")} <= labels
        assert "Acknowledged nan_loss" in result["ack_msg"]
        assert README_IMG.stat().st_size < 300_000
    finally:
        stop.set()
        if publisher is not None and not publisher.done():
            await asyncio.wait([publisher], timeout=20)
        # In a thread: the fake DingTalk server lives on this loop and must keep answering
        # while the service drains its notifier on SIGTERM.
        await asyncio.to_thread(svc.stop)
