"""Module 2's widget where learners use it: a real JupyterLab, in a real (headless) Chromium.

The test starts JupyterLab on 127.0.0.1 with a random token, serving the module 2
solution notebook cut to its set-up cell and the widget's cell, opens it with
Playwright driving Debian's ``chromium`` (browser downloads are impossible here),
runs all its cells, moves the accumulation-steps slider and waits for the plot to
change. It saves a screenshot of the widget and prints its path. The widget uses
none of the notebook's other cells; nbval runs them all, its checks among them.

`make test` installs chromium first (tests/install_chromium.sh, as root with
apt-get); where that is impossible this test is skipped with the reason.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "solutions" / "02b_unscaled_loss_learning_rate.ipynb"
CHROMIUM = Path(os.environ.get("DMUON_EDU_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LAB_SETTINGS = {
    # No "Would you like to get notified about Jupyter news?" toast over the widget.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false", "checkForUpdates": false}',
    # Start the notebook's kernel without asking: a "Select Kernel" dialog appears when the
    # kernel specs arrive after the notebook (a busy machine), and would block "Run All Cells".
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"autoStartDefaultKernel": true}',
}
SERVER_START_TIMEOUT_S = 60
SERVER_STOP_TIMEOUT_S = 15
KERNEL_START_TIMEOUT_S = 120
NOTEBOOK_RUN_TIMEOUT_S = 180
REDRAW_TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"no chromium at {CHROMIUM}: `make test` installs it with apt-get when it runs as root "
    "(tests/install_chromium.sh); otherwise run `sudo apt-get install -y chromium`, "
    "or point DMUON_EDU_CHROMIUM at a Chromium binary",
)


def _served_notebook() -> nbformat.NotebookNode:
    """The notebook's set-up cell (its imports) and the cell that shows the widget, without outputs.

    Without stored outputs and execution counts, "every cell ran" is unambiguous;
    and the test never writes to solutions/.
    """
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    [widget] = [cell for cell in code_cells if "lr_scaling_widget(" in cell.source]
    notebook.cells = [code_cells[0], widget]
    for cell in notebook.cells:
        cell.outputs, cell.execution_count = [], None
    return notebook


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab serving the notebook cut to what the widget needs (_served_notebook): (url, token)."""
    nbformat.write(_served_notebook(), tmp_path / NOTEBOOK.name)
    for name, text in LAB_SETTINGS.items():
        (tmp_path / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "settings" / name).write_text(text)
    port, token = _free_port(), secrets.token_hex(16)
    log = (tmp_path / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",  # no layout restored from earlier sessions
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(server, url, token, tmp_path / "jupyterlab.log")
        yield url, token
    finally:
        _stop_server(server, url, token)
        log.close()


def test_the_lr_widget_redraws_in_jupyterlab(jupyter_lab, tmp_path_factory, capsys):
    from playwright.sync_api import sync_playwright

    url, token = jupyter_lab
    pictures = tmp_path_factory.mktemp("browser")
    screenshot = pictures / "lr_scaling_widget.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            _run_notebook_and_move_the_slider(page, url, token, screenshot)
        except Exception:
            page.screenshot(path=str(pictures / "failure.png"), full_page=True)
            with capsys.disabled():
                print(f"\nthe browser test failed; the page at that moment: {pictures / 'failure.png'}")
            raise
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\nscreenshot of the widget after moving the slider: {screenshot}")
    assert screenshot.stat().st_size > 10_000, "the screenshot should show the widget with its plot"


def _run_notebook_and_move_the_slider(page, url: str, token: str, screenshot: Path) -> None:
    page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    # Cells run before the kernel has connected are silently not run. (Restarting the kernel
    # instead races its first start on a busy machine and breaks the widget's websocket.)
    page.wait_for_function(_KERNEL_IDLE, timeout=KERNEL_START_TIMEOUT_S * 1000)
    _menu(page, "Run", "Run All Cells")
    page.wait_for_function(_ALL_CELLS_RAN, arg=len(_served_notebook().cells), timeout=NOTEBOOK_RUN_TIMEOUT_S * 1000)
    outputs = page.locator(".jp-OutputArea-output").all_text_contents()
    assert not [text for text in outputs if "Traceback" in text], "a cell raised:\n" + "\n".join(outputs)

    plot = page.locator(".widget-image")
    plot.wait_for()
    slider = page.locator(".widget-hslider", has_text="accumulation steps N")
    readout = slider.locator(".widget-readout")
    before_src, before_n = plot.get_attribute("src"), readout.inner_text()

    # The keyboard moves the handle one step, as a learner's arrow key does. (A mouse drag
    # needs the handle's position, which shifts while images above it are still laying out.)
    slider.locator(".noUi-handle").press("ArrowRight")

    page.wait_for_function(
        "before => document.querySelector('.widget-image').src !== before",
        arg=before_src, timeout=REDRAW_TIMEOUT_S * 1000,
    )
    assert readout.inner_text() != before_n
    page.locator(".widget-vbox", has=plot).first.screenshot(path=str(screenshot))


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


# The status bar reads "Python 3 (ipykernel) | Idle" once the kernel is connected and waiting.
_KERNEL_IDLE = """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
    .some(item => item.textContent.trim().endsWith('| Idle'))"""

# Every code cell shows an execution count ("[12]:"), and the kernel is idle again.
_ALL_CELLS_RAN = """n_cells => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return prompts.length === n_cells
        && prompts.every(prompt => /\\[\\d+\\]/.test(prompt.textContent))
        && indicator !== null && indicator.dataset.status === 'idle';
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(server: subprocess.Popen, url: str, token: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop_server(server: subprocess.Popen, url: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels), then end its process group whatever happens."""
    try:
        request = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
        urllib.request.urlopen(request, timeout=5).close()
        server.wait(timeout=SERVER_STOP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if server.poll() is not None:
            break
        os.killpg(server.pid, sig)
        try:
            server.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            continue
