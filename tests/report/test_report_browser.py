"""report.html in headless Chromium: loads without console errors, sorts on a header click, filters, draws
something (screenshot pixel variance), keeps its tables with JavaScript off, prints, and stays small and fast
for a 500-layer model.

Chromium is Debian's ``chromium`` package, driven through the DevTools protocol over a pipe
(``--remote-debugging-pipe``: JSON messages separated by NUL on file descriptors 3 and 4), so no port, no
websocket library and no network are involved. Without ``/usr/bin/chromium`` the browser tests skip and say so.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import struct
import subprocess
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from conftest import SAMPLES

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--window-size=1280,900", "--remote-debugging-pipe"]
MAX_REPORT_BYTES = 5 * 1024 * 1024
MAX_LOAD_S = 3.0


class Chromium:
    """A headless Chromium with one page, spoken to with DevTools protocol messages over a pipe."""

    def __init__(self, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # in the child: Chromium reads commands on fd 3 and writes replies on fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=fds, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.page(f"{domain}.enable")

    def _send(self, method: str, params: dict | None, session: str | None) -> int:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        return self._id

    def _until(self, match, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if match(msg):
                    return msg
                self.events.append(msg)
            left = end - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            data = os.read(self._from_chrome, 1 << 20)
            if not data:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buf += data

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        i = self._send(method, params, session)
        reply = self._until(lambda m: m.get("id") == i, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def page(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        return self.call(method, params, self.session, timeout)

    def eval(self, expression: str):
        r = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"])
        return r["result"].get("value")

    def open(self, path: Path, timeout: float = 30) -> float:
        """Navigate to ``path`` and wait for its load event; returns the seconds that took."""
        self.events.clear()
        t0 = time.perf_counter()
        self.page("Page.navigate", {"url": path.resolve().as_uri()})
        self._until(lambda m: m.get("method") == "Page.loadEventFired", timeout)
        return time.perf_counter() - t0

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions seen since the last :meth:`open`."""
        self.page("Runtime.evaluate", {"expression": "0"})  # flush events queued before this point
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(json.dumps(p.get("exceptionDetails", {}))[:500])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(json.dumps(p.get("args", []))[:500])
        return out

    def click(self, selector: str) -> None:
        """A real mouse click (pressed + released) at the centre of the first element matching ``selector``."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, scale: float = 0.25) -> bytes:
        """A PNG of the viewport, scaled down (the variance check does not need every pixel)."""
        size = self.eval("[window.innerWidth, window.innerHeight]")
        clip = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": scale}
        return base64.b64decode(self.page("Page.captureScreenshot", {"format": "png", "clip": clip})["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def png_gray_pixels(png: bytes) -> list[float]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) to grey levels, with zlib only."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, body = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), f"unexpected PNG format: depth {depth}, colour type {color}"
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    grey = []
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        grey += [(line[i] + line[i + 1] + line[i + 2]) / 3 for i in range(0, stride, bpp)]
        prev = line
    return grey


def variance(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"headless Chromium not available: {CHROMIUM} is missing (Debian: apt-get install -y chromium; "
                    ".ci/run installs it)")
    b = Chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def big_report(tmp_path_factory):
    """The audit of a Sequential of 500 small layers (250 Linear + 250 Tanh)."""
    from precision_audit.audit import AuditOptions, run_audit

    base = tmp_path_factory.mktemp("big")
    (base / "model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build_model():
            torch.manual_seed(0)
            layers = []
            for _ in range(250):
                layers += [nn.Linear(8, 8), nn.Tanh()]
            return nn.Sequential(*layers)

        def sample_batch():
            torch.manual_seed(1)
            return torch.randn(4, 8)
        """))
    result = run_audit(AuditOptions(model=str(base / "model.py"), out=base / "out", steps=0))
    return base / "out" / "report.html", result.audit


def _sample_report(sample_audits, name: str) -> tuple[Path, dict]:
    _, out, _ = sample_audits.get(name)
    return out / "report.html", json.loads((out / "audit.json").read_text())


@pytest.mark.parametrize("name", SAMPLES)
def test_page_loads_without_console_errors(browser, sample_audits, name):
    path, audit = _sample_report(sample_audits, name)
    browser.open(path)
    assert browser.errors() == []
    assert browser.eval("document.querySelectorAll('#layer-table tbody tr').length") == len(audit["layers"])
    assert browser.eval("document.querySelectorAll('svg.chart').length") >= 3
    assert browser.eval("document.querySelector('.controls').hidden") is False, "the script ran"


def test_clicking_a_header_reorders_rows(browser, sample_audits):
    path, audit = _sample_report(sample_audits, "tiny_gpt")
    browser.open(path)
    col = browser.eval("""Array.from(document.querySelectorAll('#layer-table thead th'))
                          .findIndex(th => th.textContent.trim() === 'bf16 accum.')""")
    assert col > 0

    def column() -> list[float]:
        return browser.eval(f"""Array.from(document.querySelectorAll('#layer-table tbody tr'))
                               .map(r => parseFloat(r.cells[{col}].getAttribute('data-v')
                                                    || r.cells[{col}].textContent))""")

    def order() -> list[int]:
        return browser.eval("Array.from(document.querySelectorAll('#layer-table tbody tr')).map(r => r.id)")

    before = order()
    browser.click(f"#layer-table thead th:nth-child({col + 1})")
    asc = column()
    assert order() != before, "clicking the header re-orders the rows"
    assert asc == sorted(asc)
    sort_state = f"document.querySelectorAll('#layer-table thead th')[{col}].getAttribute('aria-sort')"
    assert browser.eval(sort_state) == "ascending"
    browser.click(f"#layer-table thead th:nth-child({col + 1})")
    assert column() == sorted(asc, reverse=True)
    assert sorted(order()) == sorted(before), "sorting keeps every row"
    assert browser.errors() == []


def test_filter_hides_rows(browser, sample_audits):
    path, audit = _sample_report(sample_audits, "tiny_gpt")
    browser.open(path)
    browser.click("#layer-filter")
    browser.page("Input.insertText", {"text": "linear"})
    visible = browser.eval("Array.from(document.querySelectorAll('#layer-table tbody tr'))"
                           ".filter(r => !r.hidden).length")
    expected = sum("linear" in f"{L['name']} {L['type']} {L['plan']['format']}".lower() for L in audit["layers"])
    assert 0 < visible == expected < len(audit["layers"])


def test_copy_button_copies_the_policy(browser, sample_audits):
    path, _ = _sample_report(sample_audits, "tiny_gpt")
    browser.open(path)
    browser.click("#copy-policy")
    deadline = time.monotonic() + 2
    while browser.eval("document.getElementById('copy-status').textContent") == "" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert browser.eval("document.getElementById('copy-status').textContent") == "copied"
    assert browser.errors() == []


def test_screenshot_is_not_blank_in_light_and_dark(browser, sample_audits, tmp_path):
    path, _ = _sample_report(sample_audits, "tiny_gpt")
    browser.open(path)
    for scheme in ("light", "dark"):
        browser.page("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
        png = browser.screenshot()
        (tmp_path / f"report-{scheme}.png").write_bytes(png)
        grey = png_gray_pixels(png)
        assert variance(grey) > 200, f"{scheme}: the page looks blank (grey-level variance {variance(grey):.0f})"
        mean = sum(grey) / len(grey)
        assert (mean > 128) == (scheme == "light"), f"{scheme} background (mean grey {mean:.0f})"
    browser.page("Emulation.setEmulatedMedia", {"features": []})


def test_tables_are_all_there_without_javascript(browser, sample_audits):
    path, audit = _sample_report(sample_audits, "cnn")
    browser.page("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        browser.open(path)
        assert browser.eval("document.querySelectorAll('#layer-table tbody tr').length") == len(audit["layers"])
        assert browser.eval("document.querySelectorAll('#plan-table tbody tr').length") == len(audit["layers"])
        assert browser.eval("getComputedStyle(document.querySelector('.controls')).display") == "none"
        assert browser.eval("document.getElementById('download-policy').href").startswith("data:application/json")
    finally:
        browser.page("Emulation.setScriptExecutionDisabled", {"value": False})


def test_prints_to_pdf(browser, sample_audits):
    path, _ = _sample_report(sample_audits, "mlp")
    browser.open(path)
    pdf = base64.b64decode(browser.page("Page.printToPDF", {"printBackground": False})["data"])
    assert pdf[:5] == b"%PDF-" and len(pdf) > 20_000


def test_500_layer_report_is_under_5_mb(big_report):
    path, audit = big_report
    assert len(audit["layers"]) >= 500
    size = path.stat().st_size
    assert size < MAX_REPORT_BYTES, f"report.html is {size / 1e6:.1f} MB for {len(audit['layers'])} layers"


def test_500_layer_report_loads_in_under_3_s(browser, big_report):
    path, audit = big_report
    seconds = browser.open(path)
    assert seconds < MAX_LOAD_S, f"load took {seconds:.2f} s"
    assert browser.errors() == []
    assert browser.eval("document.querySelectorAll('#layer-table tbody tr').length") == len(audit["layers"])
    t0 = time.perf_counter()
    browser.click("#layer-table thead th:nth-child(6)")
    browser.eval("0")
    assert time.perf_counter() - t0 < 1.0, "sorting 500 rows is interactive"
