"""The page of `cifarkit serve` in a real browser: Debian's headless Chromium driven by Selenium.

Skipped only where Chromium or its driver is missing outside CI; CI (CI=true) installs them (.ci/run) and fails
without them, so the page is always checked there.
"""
from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT
from servers import running_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CAT = ROOT / "examples" / "images" / "cat.png"
WAIT_S = 30

_missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
if _missing and os.environ.get("CI") != "true":
    pytest.skip(f"{' and '.join(_missing)} missing (apt-get install chromium chromium-driver); CI installs them",
                allow_module_level=True)

if os.environ.get("CI") != "true":
    pytest.importorskip("selenium", reason="selenium missing: pip install -e '.[dev]'")
from selenium import webdriver  # noqa: E402  (imported after the skips: in CI a missing selenium fails)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture
def driver(tmp_path):
    assert not _missing, f"{' and '.join(_missing)} missing: CI must install chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # Root on a closed network: no sandbox, no GPU, nothing that phones home or updates itself.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never downloads one.
    browser = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def _api_label(url: str, image: Path) -> str:
    request = urllib.request.Request(f"{url}/v1/predict", data=image.read_bytes(),
                                     headers={"Content-Type": "image/png"})
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        return json.load(response)["predictions"][0]["label"]


def _screenshot(browser, path: Path) -> None:
    assert browser.save_screenshot(str(path)), f"no screenshot written to {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, path


def test_page_classifies_an_upload_and_shows_errors(driver, tmp_path):
    wait = WebDriverWait(driver, WAIT_S)
    with running_server("--model", "B") as server:
        expected = _api_label(server.url, CAT)
        driver.get(server.url + "/")

        # The model list loads, with the server's default chosen and its card shown.
        wait.until(lambda d: d.find_element(By.ID, "model").is_enabled())
        assert driver.find_element(By.ID, "model").get_attribute("value") == "B"
        card = driver.find_element(By.ID, "card").text
        assert "fastnet" in card and "%" in card, card

        # An upload: the label the API gives for the same file, and five bars with percentages.
        driver.find_element(By.ID, "file").send_keys(str(CAT))
        wait.until(ec.text_to_be_present_in_element((By.ID, "result-label"), expected))
        assert driver.find_element(By.ID, "result-label").text == expected
        bars = driver.find_elements(By.CSS_SELECTOR, "#bars li")
        assert len(bars) == 5
        assert all(re.search(r"\d+\.\d%", bar.text) for bar in bars), [bar.text for bar in bars]
        assert bars[0].text.startswith(expected)
        assert re.search(r"\d+ ms", driver.find_element(By.ID, "latency").text)
        assert driver.find_element(By.ID, "preview").is_displayed()
        assert not driver.find_element(By.ID, "error").is_displayed()
        _screenshot(driver, tmp_path / "page.png")

        # A text file is sent as it is, and the server's answer is shown: its status and its detail.
        text = tmp_path / "notes.txt"
        text.write_text("not an image\n")
        driver.find_element(By.ID, "file").send_keys(str(text))
        wait.until(ec.visibility_of_element_located((By.ID, "error")))
        error = driver.find_element(By.ID, "error").text
        assert error.startswith("415: ") and "unsupported media type" in error and "text/plain" in error, error
        assert driver.find_element(By.ID, "result-label").text == ""
        assert driver.find_elements(By.CSS_SELECTOR, "#bars li") == []
        _screenshot(driver, tmp_path / "error.png")

        # An example image, fetched and classified by a click; the error box goes away.
        driver.find_element(By.CSS_SELECTOR, "#examples button[data-src$='ship.png']").click()
        wait.until(lambda d: d.find_element(By.ID, "result-label").text)
        assert not driver.find_element(By.ID, "error").is_displayed()
        assert len(driver.find_elements(By.CSS_SELECTOR, "#bars li")) == 5

        # The page's own files only, under the server's CSP: nothing refused, nothing failed to load.
        problems = [entry["message"] for entry in driver.get_log("browser")
                    if entry["level"] == "SEVERE" and "/v1/predict" not in entry["message"]]
        assert not problems, problems
