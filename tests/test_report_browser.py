"""The report in a real browser: headless Chromium driven over the DevTools protocol.

Chromium is started with ``--remote-debugging-pipe`` (DevTools messages over file
descriptors 3 and 4, NUL-terminated JSON), so no websocket library and no port are needed.
Host-name resolution is switched off and every request the page makes is recorded: the
report must render from the file alone. Set ``NANTRACE_SCREENSHOT_DIR`` to keep the
screenshot.

Run only these with ``pytest -m browser``; without Chromium they are skipped
(``apt-get install chromium``).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser
pytest.importorskip("plotly")

from nantrace.report import render_report  # noqa: E402
from nantrace.storage.runstore import RunStore  # noqa: E402
from test_report import NAN_STEP, _train_real  # noqa: E402

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND", "--hide-scrollbars", "--mute-audio",
)
WIDTH = 1400


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "/usr/bin/chromium"):
        found = shutil.which(name)
        if found:
            return found
    reason = "chromium not installed: apt-get install chromium"
    print(reason)
    pytest.skip(reason)


class Browser:
    """A headless Chromium page, driven with DevTools commands over a pipe."""

    def __init__(self, exe: str, profile: Path) -> None:
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        # move Chromium's ends above 10 so the dup2 to 3 and 4 in the child cannot clobber them
        high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
        os.close(to_chrome_r)
        os.close(from_chrome_w)

        def wire() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.log = profile / "chromium.log"
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile / 'profile'}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            preexec_fn=wire, pass_fds=(3, 4, high_r, high_w),
        )
        os.close(high_r)
        os.close(high_w)
        self._out = os.fdopen(to_chrome_w, "wb", buffering=0)
        self._in = os.fdopen(from_chrome_r, "rb", buffering=0)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._in.fileno(), 1 << 20)
            if not chunk:
                raise ConnectionError(f"Chromium closed the pipe; see {self.log}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        self._out.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self._read_message(deadline))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def errors(self) -> list[str]:
        """JavaScript exceptions, console errors and browser log errors seen so far."""
        found = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                found.append(f"uncaught: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
        return found

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._out.close()
        self._in.close()
        self._log_file.close()


def _open(browser: Browser, page: Path, expected_plots: int, timeout: float = 60) -> None:
    browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=1000, deviceScaleFactor=1, mobile=False)
    browser.call("Page.navigate", url=page.resolve().as_uri())
    browser.wait_event("Page.loadEventFired", timeout=timeout)
    deadline = time.monotonic() + timeout
    while browser.evaluate("document.querySelectorAll('.plotly-target .main-svg').length") < 2 * expected_plots:
        assert time.monotonic() < deadline, f"plots not rendered; errors: {browser.errors()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real run (NaN at NAN_STEP in 'features') plus per-layer statistics added to its store."""
    run_dir = tmp_path_factory.mktemp("browser") / "run"
    [incident] = _train_real(run_dir, steps=40)
    with RunStore(run_dir) as store:
        store.set_meta("layer_names", ["body.0", "body.2", "dead"])
        for step in range(40):
            store.log_layer_stats(step, [
                (0, float("nan") if step == NAN_STEP else 0.5 + step / 40, 1.0, 1e-3),
                (1, 2.0 ** (step / 4), 1.0, 1e-3 * (1 + step)),
                (2, 0.0, 1.0, 0.0),
            ])
    return render_report(run_dir), incident.id


@pytest.fixture
def browser(tmp_path: Path) -> Any:
    b = Browser(_chromium(), tmp_path)
    try:
        yield b
    finally:
        b.close()


def test_report_renders_in_chromium_without_errors_or_network(browser: Browser, report: tuple[Path, str], tmp_path):
    page, incident_id = report
    plots = ["curve-loss", "curve-norms", "curve-lr", "heatmap-layer_grad_norm", "heatmap-layer_update_ratio"]
    _open(browser, page, expected_plots=len(plots))
    state = browser.evaluate("""(() => {
        const out = {plotly: typeof Plotly === 'object' ? Plotly.version : null, plots: {}};
        document.querySelectorAll('.plotly-target').forEach(d => {
            const svg = d.querySelector('.main-svg');
            out.plots[d.id] = {width: svg ? +svg.getAttribute('width') : 0, height: svg ? +svg.getAttribute('height') : 0,
                               traces: (d.data || []).length, points: d.querySelectorAll('.scatterlayer .point').length,
                               heat: d.querySelectorAll('.hm image').length};
        });
        out.cards = [...document.querySelectorAll('article.card')].map(c => c.id);
        out.code = document.querySelector('article.card figure.code .hl')?.textContent || '';
        return out;
    })()""")
    assert state["plotly"], "plotly.js did not load from the page itself"
    assert set(plots) <= set(state["plots"])
    for name in plots:
        info = state["plots"][name]
        assert info["width"] > 600 and info["height"] > 200 and info["traces"] >= 1, (name, info)
    assert state["plots"]["curve-loss"]["points"] >= 3  # NaN ✕, skipped ■, incident ▼ drawn as marker points
    assert state["plots"]["heatmap-layer_grad_norm"]["heat"] == 1
    assert state["cards"] == [f"incident-{incident_id}"]
    assert "torch.log(x)" in state["code"]
    assert browser.errors() == []
    remote = [u for u in browser.requests() if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert remote == [], f"the report fetched {remote}"


def test_incident_click_and_linked_zoom(browser: Browser, report: tuple[Path, str]):
    page, incident_id = report
    _open(browser, page, expected_plots=5)
    # clicking an incident marker brings its card into view
    assert browser.evaluate("window.scrollY") == 0
    browser.evaluate(f"document.getElementById('curve-loss').emit('plotly_click', "
                     f"{{points: [{{customdata: '{incident_id}'}}]}})")
    deadline = time.monotonic() + 10
    while browser.evaluate(f"document.getElementById('incident-{incident_id}').getBoundingClientRect().top") > 50:
        assert time.monotonic() < deadline, "the card was not scrolled into view"
        time.sleep(0.1)
    assert browser.evaluate(f"document.getElementById('incident-{incident_id}').classList.contains('flash')")
    # zooming one plot zooms the others (curves and heatmaps share the step axis)
    browser.evaluate("Plotly.relayout('curve-loss', {'xaxis.range': [3, 9]}).then(() => true)")
    deadline = time.monotonic() + 10
    ranges: list[Any] = []
    while time.monotonic() < deadline:
        ranges = browser.evaluate("['curve-norms', 'heatmap-layer_grad_norm'].map("
                                  "id => document.getElementById(id).layout.xaxis.range)")
        if all(r and [round(v) for v in r] == [3, 9] for r in ranges):
            break
        time.sleep(0.1)
    assert all(r and [round(v) for v in r] == [3, 9] for r in ranges), ranges
    assert browser.errors() == []


def test_screenshot_of_the_whole_page(browser: Browser, report: tuple[Path, str], tmp_path: Path):
    page, _ = report
    _open(browser, page, expected_plots=5)
    height = int(browser.evaluate("document.documentElement.scrollHeight"))
    assert height > 2000
    browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=min(height, 8000), deviceScaleFactor=1,
                 mobile=False)
    time.sleep(0.5)  # let the responsive plots settle at the new size
    shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 50_000
    width = int.from_bytes(shot[16:20], "big")
    assert width == WIDTH
    out = tmp_path / "report.png"
    out.write_bytes(shot)
    keep = os.environ.get("NANTRACE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / "report.png")
    assert browser.errors() == []


def test_error_detection_works(browser: Browser, report: tuple[Path, str], tmp_path: Path):
    """Control: a page with a broken script is caught, so a clean result above means something."""
    page, _ = report
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text(encoding="utf-8").replace("</body>", "<script>notDefinedAnywhere();</script></body>"),
                      encoding="utf-8")
    _open(browser, broken, expected_plots=5)
    assert any("notDefinedAnywhere" in e for e in browser.errors())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
