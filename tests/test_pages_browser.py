"""The --html pages in a real browser (Debian's headless chromium, driven by Playwright; nothing is
downloaded): they draw from their own data with no network, colour every token by provenance or
status, show its values on hover, show transcript text as text (a reply holding `<script>` or
`"><img onerror=...>` is never markup), and stay responsive at 4,000 tokens."""
from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest
from cli_helpers import run

from replay.llamacpp.models import tiny_draft, tiny_target
from replay.paths import FIXTURES
from replay.report.pages import page

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
# as the machine's own probe starts it: no sandbox as root, and no background connections to refuse
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
TINY = FIXTURES / "transcripts" / "tiny-draft-simple.json"
COLOURS = {"accepted": (0xbf, 0xe8, 0xc7), "resampled": (0xff, 0xd2, 0x9a), "bonus": (0xb9, 0xd7, 0xff)}


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail("no /usr/bin/chromium: scripts/setup installs Debian's chromium for these tests")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """Open a page file offline; returns (page, problems): script errors, dialogs (an alert() that
    ran), and any request that is not the file itself."""
    contexts = []

    def open_(path: Path):
        ctx = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
        contexts.append(ctx)
        pg = ctx.new_page()
        problems: list[str] = []
        pg.on("pageerror", lambda e: problems.append(f"error: {e}"))
        pg.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
        pg.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
        pg.on("request", lambda r: problems.append(f"request: {r.url}") if r.url != path.as_uri() else None)
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready]", timeout=10_000)
        return pg, problems
    yield open_
    for ctx in contexts:
        ctx.close()


def _data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S).group(1))


def _pixels_of(png: bytes, rgb: tuple[int, int, int]) -> int:
    from PIL import Image
    img = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(n for n, c in img.getcolors(maxcolors=1 << 20) if c == rgb)


def test_the_trace_page_colours_every_token_by_provenance_and_shows_q_p_u_on_hover(tmp_path, open_page):
    out = tmp_path / "trace.html"
    r = run("trace", TINY, "-m", tiny_target(), "-md", tiny_draft(), "--html", out, "--json")
    assert r.exit_code == 0, r.output
    trace, data = json.loads(r.stdout), _data(out.read_text())["records"][0]
    pg, problems = open_page(out)
    for kind in ("outside", "accepted", "resampled", "bonus"):
        want = sum(t["kind"] == kind for t in data["tokens"])
        assert pg.locator(f".stream .tok.k-{kind}").count() == want, kind
    assert pg.locator(".stream .tok").count() == len(trace["emitted"]) == 20
    assert pg.inner_text(".stream").replace("\u21b5", "") == "".join(e["piece"] for e in trace["emitted"])
    steps = {s["index"]: s for s in trace["steps"]}
    for t in (t for t in data["tokens"] if t["kind"] == "resampled"):
        pg.hover(f'.stream .tok[data-i="{t["i"]}"]')
        tip = pg.inner_text("#tip")
        s = steps[t["step"]]
        assert "resampled" in tip and f'{s["target_p"][s["accepted"]]:.4f}' in tip and "rejected draft" in tip
    assert pg.locator("table.steps tbody tr").count() == len(trace["steps"])  # drafted/accepted per step
    shot = pg.screenshot(full_page=True)
    assert _pixels_of(shot, COLOURS["accepted"]) > 100 and _pixels_of(shot, COLOURS["resampled"]) > 100
    assert not problems, problems


def test_the_recover_page_shows_server_and_true_values_with_placeholders_marked(tmp_path, open_page):
    out, report = tmp_path / "recover.html", tmp_path / "report.json"
    r = run("recover", TINY, "-m", tiny_target(), "-o", tmp_path / "fixed.json", "--html", out, "--report", report)
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())["records"][0]
    pg, problems = open_page(out)
    cards = pg.inner_text(".cards")
    assert f'{rep["summary"]["true_mean_logprob"]:.4f}' in cards and f'{rep["summary"]["server_mean_logprob"]:.4f}' in cards
    assert f'{rep["summary"]["true_perplexity"]:.3f}' in cards
    assert pg.locator("svg.chart polyline").count() == 2
    assert pg.locator("svg.chart circle").count() == rep["summary"]["counts"]["placeholder"] == 19
    placeholder = next(t for t in rep["tokens"] if t["status"] == "placeholder")
    pg.hover(f'.stream .tok[data-i="{placeholder["index"]}"]')
    tip = pg.inner_text("#tip")
    assert "placeholder (recovered)" in tip and f'{placeholder["true_logprob"]:.4f}' in tip
    assert _pixels_of(pg.screenshot(full_page=True), COLOURS["resampled"]) > 100  # the placeholder colour
    assert not problems, problems


@pytest.mark.model
def test_transcript_text_is_shown_as_text_never_run_as_markup(tmp_path, open_page, smollm2):
    """SmolLM2 continuing an HTML list writes `<script>...` itself; a file path carries `"><img onerror=...>`.
    Greedy (--temp 0): a sampled reply depends on the host's kernels (a draw at t 0.8 that wrote the
    payload on an AVX2 host did not on an AMX one); this one is the same on both."""
    prompt = '"><img src=x onerror=alert(1)>\n<ul>\n<li><script>alert(2)</script></li>\n<li><script>alert(2)</script></li>\n<li>'
    out = tmp_path / "trace.html"
    r = run("trace", "-m", smollm2, "-md", smollm2, "--spec-type", "draft-simple", "--prompt", prompt, "-n", "32",
            "--temp", "0", "--html", out, "--json")
    assert r.exit_code == 0, r.output
    pieces = "".join(e["piece"] for e in json.loads(r.stdout)["emitted"])
    assert "<script>alert(2)</script>" in pieces  # the model's own reply is the payload
    pg, problems = open_page(out)
    assert pg.locator("img").count() == 0 and pg.locator("script").count() == 2
    assert " ".join(prompt.split()) in " ".join(pg.inner_text("main").split()) and pg.inner_text(".stream").replace("\u21b5", "") == pieces
    (tmp_path / "<").mkdir()
    src = tmp_path / "<" / 'script>"><img src=x onerror=alert(3)>.json'
    src.write_text(TINY.read_text())
    out = tmp_path / "recover.html"
    assert run("diff", src, "-m", tiny_target(), "--html", out).exit_code == 0
    pg2, problems2 = open_page(out)
    assert pg2.locator("img").count() == 0 and str(src) in pg2.inner_text("h2")
    assert not problems and not problems2, problems + problems2


def test_a_4000_token_trace_stays_responsive(tmp_path, open_page):
    """A real trace's tokens and steps, repeated to 4,000 tokens (the page's cost is the count):
    drawn within 2 s, a hover answered within 0.25 s at the end of the stream, the step table
    (2,600 rows) drawn on opening within 2 s."""
    small = tmp_path / "small.html"
    assert run("trace", TINY, "-m", tiny_target(), "-md", tiny_draft(), "--html", small).exit_code == 0
    data = _data(small.read_text())
    rec = data["records"][0]
    tokens, steps, n = [], [], 0
    while len(tokens) < 4000:
        base = len(steps)
        for s in rec["steps"]:
            steps.append(dict(s, index=base + s["index"]))
        for t in rec["tokens"]:
            tokens.append(dict(t, i=len(tokens), step=base + t["step"]))
        n += 1
    rec.update(tokens=tokens[:4000], steps=steps, first_divergence=None)
    big = tmp_path / "big.html"
    big.write_text(page(data, "spec-replay trace"))
    t0 = time.monotonic()
    pg, problems = open_page(big)
    drawn = time.monotonic() - t0
    assert pg.locator(".stream .tok").count() == 4000 and drawn < 2.0, drawn
    last = pg.locator('.stream .tok[data-i="3990"]')
    last.scroll_into_view_if_needed()
    t0 = time.monotonic()
    last.hover()
    pg.wait_for_function("document.getElementById('tip').textContent.includes('#3990')")
    assert time.monotonic() - t0 < 0.25
    t0 = time.monotonic()
    pg.click("details[data-testid=steps] > summary")
    pg.wait_for_selector("table.steps tbody tr >> nth=100")
    assert pg.locator("table.steps tbody tr").count() == len(steps) and time.monotonic() - t0 < 2.0
    assert not problems, problems


def test_the_tune_page_plots_speed_up_acceptance_by_position_and_the_spread_over_records(tmp_path, open_page):
    out = tmp_path / "tune.html"
    r = run("tune", TINY, "-m", tiny_target(), "-md", tiny_draft(), "--vary", "--spec-draft-n-max=1,2,8", "--measure",
            "--html", out, "--json")
    assert r.exit_code == 0, r.output
    report, data = json.loads(r.stdout), _data(out.read_text())
    pg, problems = open_page(out)
    assert pg.locator("table.ranked tbody tr").count() == len(report["settings"]) == 4
    ranked = [s["name"] for s in data["settings"]]
    speeds = [s["predicted"]["tokens_per_second"] for s in report["settings"]]
    assert ranked[0] == report["settings"][speeds.index(max(speeds))]["setting"]  # fastest first
    assert pg.locator("svg.speed rect.bar").count() == 4  # one bar per setting
    # counted (solid) and expected (dashed) acceptance by position for every setting that drafted
    assert pg.locator("svg.positions polyline.series").count() == 2 * 4
    assert pg.locator("svg.spread circle.dot").count() == 4 * len(report["settings"][0]["records"])
    pg.hover("svg.spread circle.dot >> nth=0")
    assert "decodes/token" in pg.inner_text("#tip")
    assert not problems, problems
