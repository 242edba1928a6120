"""The web console in headless Chromium against live servers.

The first test runs ``onnxforge serve`` in embedded mode (real uvicorn, real worker processes): upload a
model through the file input, watch the job finish in the live list, open its report and see the charts,
download the artifact. The model's file name is hostile HTML; the console must show it as text.

The second runs the API with API keys (the broker recorded, no worker) and drops the model on the drop
zone: the console must send the key it was given, and the job list must show only that tenant's jobs.
"""

from __future__ import annotations

import base64
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import onnx
import pytest

from core.keys import hash_key
from tests.api.conftest import make_settings, serve
from tests.conftest import FAST_PIPELINE, MODELS, Services, service_env

# About 10 s on an idle machine (the job itself takes a few); the timeout only catches a hung browser.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOSTILE_NAME = "<img src=x onerror=window.__xss=1>.onnx"
KEY = "ofk_console-test-key-0123456789abcdefghijklmnopqrs"
OTHER_KEY = "ofk_console-other-key-0123456789abcdefghijklmnopq"
T = TypeVar("T")
DROP_FILE = """
const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], "mlp_cleanup.onnx", {type: "application/octet-stream"}));
const zone = document.getElementById("dropzone");
zone.dispatchEvent(new DragEvent("dragover", {dataTransfer: transfer, bubbles: true, cancelable: true}));
zone.dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true, cancelable: true}));
"""


def _until(what: str, check: Callable[[], T], timeout: float, driver: Any = None) -> T:
    """Poll ``check`` until it returns something true. The job list is redrawn while we look at it, so an
    element found a moment ago may be gone: that counts as "not yet"."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            state = ""
            if driver is not None:
                state = driver.execute_script("return document.body.innerText")[:3000]
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{state}")
        time.sleep(0.1)


def _text(driver: Any, element_id: str) -> str:
    return str(driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id))


def test_console_uploads_follows_reports_and_downloads_when_served_embedded(
    browser: Any, services: Services, tmp_path: Path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    api = services.serve(service_env(tmp_path / "data", **FAST_PIPELINE), embedded=True)
    model = tmp_path / "upload" / HOSTILE_NAME
    model.parent.mkdir()
    shutil.copyfile(MODELS / "mlp_cleanup.onnx", model)

    # GET / redirects to the console; the preset list comes from /v1/passes.
    browser.get(f"{api.url}/")
    assert browser.current_url == f"{api.url}/console/"
    _until("the presets", lambda: "safe" in [o.text for o in Select(browser.find_element(By.ID, "preset")).options], 15)
    Select(browser.find_element(By.ID, "preset")).select_by_value("safe")
    Select(browser.find_element(By.ID, "rollback-slower")).select_by_value("false")

    # Upload through the file input (what a drop does: it sets the input's files).
    browser.find_element(By.ID, "model-file").send_keys(str(model))
    assert HOSTILE_NAME in _text(browser, "model-chosen")
    browser.find_element(By.ID, "submit").click()
    status = _until("the submission", lambda: "Submitted job" in _text(browser, "upload-status"), 30, browser)
    assert status
    job_id = _text(browser, "upload-status").removeprefix("Submitted job ").rstrip(".")

    # The live list (polled every 2 s) shows the job until it succeeds.
    row_selector = f'tr[data-job-id="{job_id}"]'
    _until("the job in the list", lambda: browser.find_elements(By.CSS_SELECTOR, row_selector), 10, browser)
    _until(
        "the job to succeed",
        lambda: browser.find_element(By.CSS_SELECTOR, row_selector).get_attribute("data-state") == "succeeded",
        45,
        browser,
    )
    browser.save_screenshot(str(tmp_path / "console-jobs.png"))
    row = browser.find_element(By.CSS_SELECTOR, row_selector)  # a finished list is no longer redrawn
    assert HOSTILE_NAME in row.text  # shown as text ...
    assert not browser.find_elements(By.CSS_SELECTOR, "#jobs img")  # ... never parsed as HTML
    assert browser.execute_script("return window.__xss") is None
    job = httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=10).json()
    assert job["config"]["preset"] == "safe" and job["config"]["rollback_slower"] is False

    # The report page: the server's report.html in a sandboxed frame, with its SVG charts visible.
    row.find_element(By.CLASS_NAME, "report-link").click()
    frame = _until(
        "the report frame",
        lambda: [f for f in browser.find_elements(By.ID, "report-frame") if f.is_displayed()],
        15,
        browser,
    )[0]
    assert frame.get_attribute("sandbox") == ""
    assert frame.size["height"] > 300
    browser.switch_to.frame(frame)
    try:
        charts = _until("the charts", lambda: browser.find_elements(By.TAG_NAME, "svg"), 10)
        assert len(charts) >= 3, "latency per pass, benchmark boxes, op histogram"
        for chart in charts:
            assert chart.is_displayed()
            assert chart.size["width"] > 100 and chart.size["height"] > 50
        assert "onnxforge report" in browser.find_element(By.TAG_NAME, "h1").text
        assert not browser.find_elements(By.TAG_NAME, "img")  # the file name is escaped here too
        charts[0].screenshot(str(tmp_path / "console-chart.png"))
    finally:
        browser.switch_to.default_content()
    browser.execute_script("document.getElementById('report-frame').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "console-report.png"))

    # Download the artifact by clicking its link: the same bytes the API serves.
    link = browser.find_element(By.ID, "artifact-link")
    assert link.is_displayed()
    link.click()
    downloads: Path = browser.downloads
    done = _until("the download", lambda: [p for p in downloads.glob("*.onnx") if p.stat().st_size > 0], 15)
    _until("the download to finish", lambda: not list(downloads.glob("*.crdownload")), 15)
    served = httpx.get(f"{api.url}/v1/jobs/{job_id}/artifact", timeout=30).content
    assert done[0].read_bytes() == served
    onnx.checker.check_model(onnx.load(str(done[0])))

    # Back to the list through the page's own link.
    browser.find_element(By.LINK_TEXT, "← all jobs").click()
    _until("the job list", lambda: browser.find_element(By.ID, "page-jobs").is_displayed(), 5)


def test_console_sends_the_key_and_lists_only_its_tenants_jobs_when_keys_are_configured(browser: Any, tmp_path: Path):
    from selenium.webdriver.common.by import By

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    settings = make_settings(data_dir, auth={"keys": {"team-a": [hash_key(KEY)], "team-b": [hash_key(OTHER_KEY)]}})
    with serve(settings) as live:
        # Another tenant's job exists; it must never show up.
        with (MODELS / "mlp_cleanup.onnx").open("rb") as f:
            theirs = httpx.post(
                f"{live.base_url}/v1/jobs",
                files={"model": ("theirs.onnx", f)},
                headers={"Authorization": f"Bearer {OTHER_KEY}"},
                timeout=30,
            )
        assert theirs.status_code == 202, theirs.text
        browser.get(f"{live.base_url}/console/")
        # Without a key every /v1 call is refused, and the page says so.
        _until("the key banner", lambda: "API key" in _text(browser, "banner"), 10, browser)
        assert not browser.find_elements(By.CSS_SELECTOR, "tr[data-job-id]")

        browser.find_element(By.ID, "api-key").send_keys(KEY)
        browser.find_element(By.ID, "key-save").click()
        assert browser.execute_script("return sessionStorage.getItem('onnxforge.apiKey')") == KEY
        _until("the presets", lambda: "safe" in _text(browser, "preset"), 10, browser)

        # Drop the model on the drop zone: a real drop event carrying the file, as a drag from the desktop.
        browser.execute_script(DROP_FILE, base64.b64encode((MODELS / "mlp_cleanup.onnx").read_bytes()).decode())
        assert "mlp_cleanup.onnx" in _text(browser, "model-chosen")
        browser.find_element(By.ID, "submit").click()
        _until("the submission", lambda: "Submitted job" in _text(browser, "upload-status"), 15, browser)
        job_id = _text(browser, "upload-status").removeprefix("Submitted job ").rstrip(".")
        assert job_id in [queued for queued, _ in live.dispatcher.enqueued]
        row = _until(
            "the queued job in the list",
            lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-job-id="{job_id}"]'),
            10,
            browser,
        )[0]
        assert row.get_attribute("data-state") == "queued"
        listed = [r.get_attribute("data-job-id") for r in browser.find_elements(By.CSS_SELECTOR, "tr[data-job-id]")]
        assert listed == [job_id], "team-b's job must not be listed for team-a's key"
        owned = httpx.get(
            f"{live.base_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
        ).json()
        assert owned["model"]["filename"] == "mlp_cleanup.onnx"


def test_console_sends_pass_options_and_shows_the_refusal_naming_the_option_when_one_is_bad(
    browser: Any, services: Services, tmp_path: Path
):
    from selenium.webdriver.common.by import By

    api = services.serve(service_env(tmp_path / "data", **FAST_PIPELINE), embedded=True)
    model = tmp_path / "mlp_cleanup.onnx"
    shutil.copyfile(MODELS / "mlp_cleanup.onnx", model)
    browser.get(f"{api.url}/console/")
    _until("the pass buttons", lambda: browser.find_elements(By.CSS_SELECTOR, ".pass-buttons button"), 15)
    browser.find_element(By.ID, "mode-explicit").click()
    buttons = {b.text: b for b in browser.find_elements(By.CSS_SELECTOR, ".pass-buttons button")}
    buttons["+ identity_elimination"].click()
    buttons["+ constant_folding"].click()
    assert browser.find_element(By.ID, "pass-names").get_attribute("value") == "identity_elimination, constant_folding"
    assert "max_output_bytes" in _text(browser, "pass-options-help")  # from the pass's options schema
    browser.find_element(By.ID, "model-file").send_keys(str(model))
    options = browser.find_element(By.ID, "pass-options")

    # Not JSON, and options for a pass that is not in the list: refused in the page, nothing sent.
    for text, words in [("{nope", "not valid JSON"), ('{"float16": {}}', "not in the list")]:
        options.clear()
        options.send_keys(text)
        browser.find_element(By.ID, "submit").click()
        _until(words, lambda words=words: words in _text(browser, "upload-status"), 5, browser)
    assert httpx.get(f"{api.url}/v1/jobs", timeout=10).json()["jobs"] == []

    # An option the pass does not have: the server's 422 names it.
    options.clear()
    options.send_keys('{"constant_folding": {"max_bytes": 4096}}')
    browser.find_element(By.ID, "submit").click()
    _until("the refusal", lambda: "Refused" in _text(browser, "upload-status"), 15, browser)
    refusal = _text(browser, "upload-status")
    assert "INVALID_PASS_OPTIONS" in refusal and "max_bytes" in refusal

    # A valid option travels as {"name", "options"}; the other pass stays a bare name.
    options.clear()
    options.send_keys('{"constant_folding": {"max_output_bytes": 4096}}')
    browser.find_element(By.ID, "submit").click()
    _until("the submission", lambda: "Submitted job" in _text(browser, "upload-status"), 30, browser)
    job_id = _text(browser, "upload-status").removeprefix("Submitted job ").rstrip(".")
    passes = httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=10).json()["config"]["passes"]
    names = [p if isinstance(p, str) else p["name"] for p in passes]
    assert names == ["identity_elimination", "constant_folding"]
    folding = next(p for p in passes if not isinstance(p, str) and p["name"] == "constant_folding")
    assert folding["options"]["max_output_bytes"] == 4096
