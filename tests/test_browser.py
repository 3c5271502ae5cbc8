"""JupyterLab in a real browser: start it the way `make lab` does, open lab 00 in headless Chromium,
run every cell, and check that no cell failed and a plot rendered. A screenshot lands in
build/screenshots/. Needs Debian's `chromium` and `chromium-driver` (installed by .ci/run) and
selenium; skipped where they are missing. The browser is told where both binaries are, so
nothing is downloaded."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = "00_gpu_setup.ipynb"
SCREENSHOT = ROOT / "build" / "screenshots" / "lab00_jupyterlab.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="needs Debian's chromium and chromium-driver (apt install chromium chromium-driver)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s")


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server started by `python -m labkit lab` on a copy of lab 00, with its own settings."""
    root = tmp_path / "labs"
    root.mkdir()
    shutil.copy(ROOT / "labs" / LAB, root / LAB)  # the browser run must not rewrite the committed notebook
    settings = tmp_path / "settings" / "@jupyterlab"
    for plugin, values in (("notebook-extension/tracker", {"windowingMode": "none"}),  # every cell in the DOM
                           ("apputils-extension/notification", {"fetchNews": "false"})):  # offline: no news
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "labkit", "lab", "--root", str(root), "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", proc, timeout=120)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "jupyterlab.log").read_text()[-3000:])


@pytest.fixture
def browser(tmp_path, monkeypatch):
    """Headless Debian Chromium through its own chromedriver; no background traffic, no downloads."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _prompts(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]"
        ".map(e => e.textContent.trim())")


def test_lab00_runs_in_jupyterlab_in_headless_chromium(jupyterlab, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    base, token = jupyterlab
    browser.get(f"{base}/lab/tree/{LAB}?token={token}")
    wait = WebDriverWait(browser, 120)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")))
    wait.until(lambda d: d.execute_script(
        "const s = document.querySelector('.jp-Notebook-ExecutionIndicator');"
        "return s !== null && s.getAttribute('data-status') === 'idle'"))
    _accept_dialogs(browser)  # "Select Kernel" may ask for the notebook's kernel
    n_code = len(_prompts(browser))
    assert n_code > 5, f"lab 00 shows only {n_code} code cells"

    browser.find_element(By.XPATH, "//li[contains(@class,'lm-MenuBar-item')][.//div[text()='Run']]").click()
    wait.until(ec.element_to_be_clickable(
        (By.CSS_SELECTOR, "li.lm-Menu-item[data-command='runmenu:run-all']"))).click()
    _accept_dialogs(browser)

    def finished(d) -> bool:
        prompts = _prompts(d)
        return not any("*" in p for p in prompts) and (all(p.strip("[]: ") for p in prompts) or _errors(d))

    WebDriverWait(browser, 600, poll_frequency=1).until(finished)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))

    errors = _errors(browser)
    assert not errors, "cells failed in JupyterLab:\n" + "\n---\n".join(errors)
    assert all(p.strip("[]: ").isdigit() for p in _prompts(browser)), "some cells did not run"
    plots = browser.execute_script(
        "return [...document.querySelectorAll('.jp-OutputArea-output img')]"
        ".filter(i => i.complete && i.naturalWidth > 100).length")
    assert plots >= 1, "no plot rendered"


def _accept_dialogs(driver) -> None:
    time.sleep(1)  # a dialog opens a moment after the action that causes it
    for button in driver.find_elements("css selector", ".jp-Dialog .jp-Dialog-button.jp-mod-accept"):
        button.click()


def _errors(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')]"
        ".filter(e => e.closest('.jp-OutputArea-child') !== null && /Traceback|Error/.test(e.textContent)"
        " && e.querySelector('.ansi-red-fg, .ansi-red-intense-fg') !== null)"
        ".map(e => e.textContent.slice(0, 2000))")
