"""JupyterLab and TensorBoard in a real browser: start JupyterLab the way `make lab` does, open lab 00 in headless
Chromium, run every cell, and check that no cell failed and a plot rendered; start TensorBoard the way
`make tensorboard` does on a training run's logs, and check that its loss curve shows. A screenshot lands in
build/screenshots/. Needs Debian's `chromium` and `chromium-driver` (installed by .ci/run) and
selenium; skipped where they are missing. The browser is told where both binaries are, so
nothing is downloaded.

The test drives JupyterLab through its stable surface, not its menus' markup: the server exposes the
application object (`--LabApp.expose_app_in_browser`, as JupyterLab's own UI tests do) and the test
runs the documented `notebook:run-all-cells` command. It waits on what a user sees (every code
cell's prompt numbered, no cell busy, the kernel idle) with bounded timeouts, on a copy of the lab
whose outputs were cleared, so a numbered prompt can only come from this run. A failure saves a
screenshot and the browser console under build/screenshots/ and names the last state seen.
"""

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

import nbformat
import pytest

from labcourse.cli import START_PAGE

ROOT = Path(__file__).resolve().parents[1]
LAB = "00_gpu_setup.ipynb"
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
OPEN_TIMEOUT = 120  # JupyterLab's page and a kernel on a busy 2-core machine
RUN_TIMEOUT = 240  # lab 00 runs in about 25 s in the smoke profile

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (apt install chromium chromium-driver)",
    ),
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


def _copy_cleared(source: Path, target: Path) -> None:
    """The notebook without outputs or execution counts: only this run can number its prompts."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, target)


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server started by `python -m labcourse lab` on a folder of its own, with its own settings."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = tmp / "labs"
    root.mkdir()
    shutil.copy(ROOT / "labs" / START_PAGE, root / START_PAGE)  # as `make lab` puts it beside the labs
    settings = tmp / "settings" / "@jupyterlab"
    for plugin, values in (("notebook-extension/tracker", {"windowingMode": "none"}),):  # every cell in the DOM
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    with open(tmp / "jupyterlab.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "labcourse",
                "lab",
                "--root",
                str(root),
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                f"--IdentityProvider.token={token}",
                "--LabApp.expose_app_in_browser=True",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_for_server(f"{base}/api/status?token={token}", proc, timeout=OPEN_TIMEOUT)
            yield base, token, root
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print((tmp / "jupyterlab.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium through its own chromedriver; no background traffic, no downloads."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console log, saved on a failure
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch a driver
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(OPEN_TIMEOUT)  # Selenium's default is 300 s
        try:
            yield driver
        finally:
            driver.quit()


# What a user would see, read in one script: the open notebook, its kernel, its prompts, dialogs, failed cells.
_STATE_JS = """
const app = window.jupyterapp;
const panel = app ? app.shell.currentWidget : null;
const notebook = panel && panel.content && panel.content.model && panel.sessionContext ? panel : null;
const kernel = notebook && notebook.sessionContext.session ? notebook.sessionContext.session.kernel : null;
const root = notebook ? notebook.node : document;  // the open notebook only, not other tabs
const prompts = [...root.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
  .map(e => e.textContent.trim());
const indicator = root.querySelector('.jp-Notebook-ExecutionIndicator');
const errors = [...root.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .filter(e => e.closest('.jp-OutputArea-child') !== null && /Traceback|Error/.test(e.textContent)
          && e.querySelector('.ansi-red-fg, .ansi-red-intense-fg') !== null)
  .map(e => e.textContent.slice(0, 2000));
return {
  notebook: notebook ? notebook.context.path : null,
  kernel: kernel ? kernel.status : null,
  indicator: indicator ? indicator.getAttribute('data-status') : null,
  cells: prompts.length,
  ran: prompts.filter(p => /\\d/.test(p)).length,
  busy: prompts.map((p, i) => p.includes('*') ? i : -1).filter(i => i >= 0),
  dialogs: [...document.querySelectorAll('.jp-Dialog .jp-Dialog-header')].map(e => e.textContent.trim()),
  errors: errors,
  run_error: window.labkitRunError || null,  // set if the run-all command rejected
};
"""


def _state(driver) -> dict:
    return driver.execute_script(_STATE_JS)


def _describe(state: dict) -> str:
    """The last state seen, in words, for an assertion message."""
    parts = [
        f"{state['ran']} of {state['cells']} code cells ran",
        f"busy cells {state['busy']}" if state["busy"] else "no cell busy",
        f"kernel {state['kernel']}",
        f"open notebook {state['notebook']!r}",
        f"dialogs open {state['dialogs']}" if state["dialogs"] else "no dialog open",
        f"{len(state['errors'])} failed cell(s)",
    ]
    if state["run_error"]:
        parts.append(f"the run-all command failed: {state['run_error']}")
    return "; ".join(parts)


def _fail(driver, name: str, why: str) -> None:
    """Save a screenshot and the console log under build/screenshots/, then fail naming the last state."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / f"{name}_failure.png"
    driver.save_screenshot(str(shot))
    from selenium.common.exceptions import WebDriverException

    try:
        console = "\n".join(f"{e['level']} {e['message']}" for e in driver.get_log("browser"))
    except WebDriverException as exc:  # the log is a help, not the point: never hide the failure behind it
        console = f"(console log unavailable: {exc})"
    (SCREENSHOTS / f"{name}_console.log").write_text(console)
    state = _state(driver)
    errors = "\n---\n".join(state["errors"])
    pytest.fail(
        f"{why}: {_describe(state)}. Screenshot {shot.relative_to(ROOT)}, console log beside it."
        + (f"\nFailed cells:\n{errors}" if errors else ""),
        pytrace=False,
    )


def _wait(driver, name: str, done, timeout: float, what: str) -> dict:
    """Poll the page state until `done(state)`, accepting the kernel dialog wherever it appears."""
    deadline = time.monotonic() + timeout
    while True:
        _accept_kernel_dialog(driver)
        state = _state(driver)
        if done(state):
            return state
        if time.monotonic() > deadline:
            _fail(driver, name, f"{what} not seen within {timeout:.0f} s")
        time.sleep(1)


def _accept_kernel_dialog(driver) -> None:
    """'Select Kernel' may ask for the notebook's kernel, on opening or later: take the proposed one."""
    for dialog in driver.find_elements("css selector", ".jp-Dialog"):
        header = dialog.find_elements("css selector", ".jp-Dialog-header")
        if header and "kernel" in header[0].text.lower():
            for button in dialog.find_elements("css selector", ".jp-Dialog-button.jp-mod-accept"):
                button.click()


def run_in_jupyterlab(driver, base: str, token: str, path: str, name: str) -> dict:
    """Open `path` in JupyterLab, run every cell with its run-all command, and return the final page state."""
    driver.get(f"{base}/lab/tree/{path}?token={token}")
    _wait(
        driver,
        name,
        lambda s: s["notebook"] == path and s["kernel"] == "idle" and s["cells"] > 0,
        OPEN_TIMEOUT,
        f"{path} open with an idle kernel",
    )
    refused = driver.execute_script(  # started, not awaited: the command's promise ends with the run
        "const c = window.jupyterapp.commands, id = 'notebook:run-all-cells';"
        "if (!c.hasCommand(id) || !c.isEnabled(id)) return 'the command is missing or disabled';"
        "c.execute(id).catch(e => { window.labkitRunError = String(e); }); return null;"
    )
    if refused:
        _fail(driver, name, f"JupyterLab cannot run all cells: {refused}")
    return _wait(
        driver,
        name,
        lambda s: (
            not s["busy"]
            and s["kernel"] == "idle"
            and s["indicator"] == "idle"
            and (s["ran"] == s["cells"] or s["errors"])
        ),
        RUN_TIMEOUT,
        "every code cell run (or one failed)",
    )


def test_jupyterlab_opens_on_the_start_page_rendered_without_a_news_popup(jupyterlab, browser):
    base, token, _ = jupyterlab
    browser.get(f"{base}/?token={token}")  # where `make lab` points the browser: the server sends it on
    title = (ROOT / "labs" / START_PAGE).read_text().splitlines()[0].removeprefix("# ")
    seen: dict = {}
    start = time.monotonic()
    while time.monotonic() < start + OPEN_TIMEOUT:
        seen = browser.execute_script(
            "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
            "const h1 = w && w.node.querySelector('.jp-RenderedMarkdown h1');"
            "return {tab: w ? w.title.label : null, h1: h1 ? h1.textContent : null,"
            " toasts: [...document.querySelectorAll('.Toastify__toast')].map(t => t.textContent)};"
        )
        if seen["h1"] and seen["h1"].startswith(title):
            break
        time.sleep(1)
    else:
        _fail(browser, "start_page", f"the start page did not open rendered; last seen {seen}")
    assert seen["tab"] == START_PAGE
    assert not [t for t in seen["toasts"] if "news" in t.lower()], seen["toasts"]
    # the server's own defaults, which the pop-up and the viewer read: no news, Markdown rendered
    with urllib.request.urlopen(
        f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}", timeout=10
    ) as response:
        notification = json.load(response)["schema"]["properties"]
    assert notification["fetchNews"]["default"] == "false"
    assert notification["checkForUpdates"]["default"] is False
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "start_page.png"))


def test_lab00_runs_in_jupyterlab_in_headless_chromium(jupyterlab, browser):
    base, token, root = jupyterlab
    _copy_cleared(ROOT / "labs" / LAB, root / LAB)  # the browser run must not rewrite the committed notebook
    state = run_in_jupyterlab(browser, base, token, LAB, "lab00_jupyterlab")
    assert state["cells"] > 5, f"lab 00 shows only {state['cells']} code cells"
    if state["errors"] or state["ran"] != state["cells"]:
        _fail(browser, "lab00_jupyterlab", "lab 00 did not run cleanly in JupyterLab")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOTS / "lab00_jupyterlab.png"))
    plots = browser.execute_script(
        "return [...window.jupyterapp.shell.currentWidget.node.querySelectorAll('.jp-OutputArea-output img')]"
        ".filter(i => i.complete && i.naturalWidth > 100).length"
    )
    assert plots >= 1, "no plot rendered"


def test_a_failing_cell_is_reported_with_a_screenshot_and_the_state(jupyterlab, browser):
    """The failure path: a notebook whose second cell raises stops there, and the report says so."""
    base, token, root = jupyterlab
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in ("x = 1", "raise ValueError('a planted failure')", "y = 2")]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "failing.ipynb")
    for stale in SCREENSHOTS.glob("failing_*"):
        stale.unlink()
    start = time.monotonic()
    state = run_in_jupyterlab(browser, base, token, "failing.ipynb", "failing")
    assert state["ran"] == 2 and state["cells"] == 3, _describe(state)  # run-all stops at the error
    assert any("a planted failure" in e for e in state["errors"])
    with pytest.raises(pytest.fail.Exception) as failure:
        _fail(browser, "failing", "the planted cell failed")
    message = str(failure.value)
    assert "2 of 3 code cells ran" in message and "a planted failure" in message
    assert (SCREENSHOTS / "failing_failure.png").stat().st_size > 0
    assert (SCREENSHOTS / "failing_console.log").exists()
    assert time.monotonic() - start < OPEN_TIMEOUT + 60  # found quickly, not after the run timeout


def test_tensorboard_shows_a_training_runs_curves(browser, tmp_path):
    """`labcourse tensorboard` on a run that `fit` logged: the Time Series page lists the run and its train/loss
    card."""
    pytest.importorskip("tensorboard")
    import torch

    from labkit.models import tiny_llama
    from labkit.train import TrainConfig, fit

    model = tiny_llama(64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    data = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(6)]
    fit(model, data, TrainConfig(steps=6, progress=False, tensorboard_dir=str(tmp_path / "runs" / "lab10")))
    port = _free_port()
    with open(tmp_path / "tensorboard.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "labcourse", "tensorboard", "--logdir", str(tmp_path / "runs"), f"--port={port}"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/data/runs", proc, timeout=OPEN_TIMEOUT)
        browser.get(f"{base}/#timeseries")
        deadline = time.monotonic() + OPEN_TIMEOUT
        tag_filter = "input[placeholder*='Filter tags']"  # cards render when scrolled to: show the train/ group
        while not (boxes := browser.find_elements("css selector", tag_filter)) and time.monotonic() < deadline:
            time.sleep(1)
        if boxes:
            from selenium.webdriver.common.keys import Keys

            boxes[0].send_keys("^train/", Keys.ESCAPE)  # the filter, without its suggestion list
        # the page's lines (run names, card titles, which show "train" and "/loss" on two lines), once no suggestion
        # list is open
        page = "return document.querySelector('mat-option') ? '' : document.body.innerText"
        while not {"lab10", "train/loss"} <= {
            x.strip() for x in browser.execute_script(page).replace("\n/", "/").split("\n")
        }:
            if time.monotonic() > deadline:
                SCREENSHOTS.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(SCREENSHOTS / "tensorboard_failure.png"))
                pytest.fail(f"TensorBoard did not show run lab10 and its train/loss card within {OPEN_TIMEOUT} s")
            time.sleep(1)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOTS / "tensorboard.png"))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
