"""Open the rendered report in Debian's headless Chromium and check what a reader would see.

Chromium is driven through its own DevTools protocol over a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL on file descriptors 3 and 4), so no websocket client and no
downloaded browser are needed. Checks: every figure decodes with a nonzero size, the claims
table is there with one row per claim, no table is wider than its column in a laptop's window
(:data:`WINDOW`), the page logs no console error or exception, and it asks for nothing outside
itself (no network request other than data: URIs and the file itself).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path

import pytest

import synthetic
from persistentkv import claims
from persistentkv.commands.claims import judged
from persistentkv.render import FIGURE_NAMES, figures, report
from persistentkv.results import load_results

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium "
                                "(apt-get install chromium); .ci/run installs it")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--remote-debugging-pipe"]
#: A laptop's browser window: the report's tables must fit its column there.
WINDOW = (1280, 900)
PROBE = """(async () => {
  const imgs = [...document.images];
  const out = [];
  for (const img of imgs) {
    let decoded = true;
    try { await img.decode(); } catch (e) { decoded = false; }
    const r = img.getBoundingClientRect();
    out.push({name: img.dataset.figure || img.alt, decoded, w: img.naturalWidth, h: img.naturalHeight,
              shown: r.width * r.height});
  }
  const svgs = [...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().width);
  const tables = [...document.querySelectorAll('table')].map(t => {
    const box = t.parentElement, style = getComputedStyle(box);
    let label = t.previousElementSibling;
    while (label && !/^H[23]$/.test(label.tagName)) label = label.previousElementSibling;
    return {name: t.id || (label ? label.textContent.trim() : box.id),
            width: Math.max(t.getBoundingClientRect().width, t.scrollWidth),
            column: box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)};
  });
  return JSON.stringify({images: out, svgs, tables, page: document.documentElement.scrollWidth,
    window: window.innerWidth,
    claimRows: document.querySelectorAll('#claims-table tbody tr').length,
    verdicts: [...document.querySelectorAll('#claims-table .badge')].map(b => b.textContent.trim()),
    title: document.title});
})()"""


class DevTools:
    """Minimal Chrome DevTools Protocol client over --remote-debugging-pipe."""

    def __init__(self, user_data_dir: Path):
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child_fds():
            # Chromium reads commands on fd 3 and writes replies on fd 4; lift both pipe ends above
            # 4 first, so neither is clobbered by the other's dup2.
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=child_fds, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            event = self._read(max(0.1, deadline - time.monotonic()))
            if event.get("method") == method:
                return event
            self.events.append(event)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise TimeoutError("no reply from Chromium")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 16)
                if not chunk:
                    raise TimeoutError("Chromium closed the DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[dict, list[dict]]:
    """Load ``page``; return (what PROBE saw, the DevTools events logged while loading)."""
    tools = DevTools(tmp_path / "chromium-profile")
    try:
        target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            tools.send(f"{domain}.enable", session=session)
        tools.send("Emulation.setDeviceMetricsOverride", {"width": WINDOW[0], "height": WINDOW[1],
                                                          "deviceScaleFactor": 1, "mobile": False}, session=session)
        tools.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        tools.wait_event("Page.loadEventFired", timeout=60)
        result = tools.send("Runtime.evaluate", {"expression": PROBE, "awaitPromise": True, "returnByValue": True},
                            session=session, timeout=60)
        probe = json.loads(result["result"]["value"])
        return probe, list(tools.events)
    finally:
        tools.close()


def problems(events: list[dict], page: Path) -> list[str]:
    """Console errors, uncaught exceptions and requests that leave the page."""
    out = []
    for e in events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            out.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            out.append(f"console.{params['type']}: {params.get('args')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            out.append(f"log error: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            if not (url.startswith("data:") or url == page.resolve().as_uri()):
                out.append(f"request outside the page: {url}")
        elif method == "Network.loadingFailed":
            out.append(f"load failed: {params.get('errorText')}")
    return out


def too_wide(probe: dict) -> list[str]:
    """Tables wider than the column they sit in (a reader would have them cut off), and the page
    itself when it scrolls sideways."""
    out = [f"{t['name']}: {t['width']:.0f} px in a {t['column']:.0f} px column" for t in probe["tables"]
           if t["width"] > t["column"] + 0.5]
    if probe["page"] > probe["window"]:
        out.append(f"the page: {probe['page']} px in a {probe['window']} px window")
    return out


def build_report(root: Path, measured: bool) -> Path:
    """Render a report from synthetic results (or from nothing) into ``root``."""
    hw_dir = synthetic.write_results(root, hw="synthetic-gpu", fp8=True) if measured else root / "results" / "nvidia-h200"
    results = load_results(hw_dir, root / "results" / "counters", synthetic.config())
    payload = judged(results)  # claims.json's payload, the floor's and FP8's entries included
    figures.render_all(results, root / "figs", "svg")
    return report.render(payload, results, root / "figs", hw_dir / "report.html")


@pytest.mark.parametrize("measured", [True, False], ids=["synthetic-results", "nothing-measured"])
def test_report_opens_offline_with_every_figure(tmp_path, measured):
    page = build_report(tmp_path, measured)
    probe, events = open_in_chromium(page, tmp_path)

    # every figure once: the gallery's in FIGURE_NAMES order, the FP8 one in its section above it
    names = [img["name"] for img in probe["images"]]
    assert names == ["fp8"] + [n for n in FIGURE_NAMES if n != "fp8"]
    for img in probe["images"]:
        assert img["decoded"], f"figure {img['name']} did not decode"
        assert img["w"] > 100 and img["h"] > 50, f"figure {img['name']} has size {img['w']}x{img['h']}"
        assert img["shown"] > 0, f"figure {img['name']} is not laid out"
    assert probe["claimRows"] == len(claims.CLAIMS)
    assert len(probe["verdicts"]) == len(claims.CLAIMS)
    assert set(probe["verdicts"]) <= set(claims.VERDICTS)
    if not measured:
        # Nothing measured: timing claims must say so (counters are absent too here).
        assert set(probe["verdicts"]) == {claims.NOT_MEASURED}
    assert problems(events, page) == []
    assert len(probe["tables"]) >= 3 and too_wide(probe) == []


COMMITTED = Path(__file__).resolve().parents[1] / "results" / "nvidia-h200" / "report.html"


@pytest.mark.skipif(not COMMITTED.is_file(), reason="the repository's rendered report is not there")
def test_committed_report_fits_a_laptop_window(tmp_path):
    """The report the repository ships, with its real run ids, hashes and intervals: every table
    fits its column at WINDOW's width, and nothing in it is broken."""
    probe, events = open_in_chromium(COMMITTED, tmp_path)
    assert too_wide(probe) == []
    assert all(img["decoded"] and img["w"] > 100 for img in probe["images"])
    assert problems(events, COMMITTED) == []


def test_probe_detects_a_table_wider_than_its_column(tmp_path):
    """The width check can fail: a table with a long unbreakable cell is caught, by its heading."""
    page = build_report(tmp_path, measured=False)
    html = page.read_text()
    wide = '<h3>Too wide</h3><table><tr><td><code>' + "0123456789abcdef" * 20 + '</code></td></tr></table>'
    spoilt = tmp_path / "wide.html"
    spoilt.write_text(html.replace('<section id="provenance">', '<section id="provenance">' + wide, 1))
    probe, _ = open_in_chromium(spoilt, tmp_path)
    assert [w.split(":")[0] for w in too_wide(probe)] == ["Too wide", "the page"]


def test_probe_detects_a_broken_figure(tmp_path):
    """The check can fail: a report whose image data is corrupt must be caught."""
    page = build_report(tmp_path, measured=False)
    html = page.read_text()
    start = html.index("data:image/svg+xml;base64,") + len("data:image/svg+xml;base64,")
    broken = tmp_path / "broken.html"
    broken.write_text(html[:start] + "bm90IGFuIFNWRw==" + html[html.index('"', start):])
    probe, _ = open_in_chromium(broken, tmp_path)
    assert not probe["images"][0]["decoded"] or probe["images"][0]["w"] == 0
    assert all(img["decoded"] for img in probe["images"][1:])
