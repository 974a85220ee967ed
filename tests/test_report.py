"""`infervisor report`: the three outcomes, what it does not prove, one promise per figure, and a page that prints."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor.toolkit.harden import Target, check_thermal
from infervisor.supervisor.toolkit.probe import STAGES
from infervisor.supervisor.toolkit.provenance import cpu_model, infervisor_command
from tests.conftest import ROOT

EXAMPLE = ROOT / "configs" / "constraints.example.json"
TARGET_CPU = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
CHOSEN = ["int8_static", "jit", "eager"]
SERVED_BY_DEFAULT = ["int8_static", "jit_onednn", "eager"]
WRITTEN = "/etc/infervisor/config.json"


def _measured_on(cpu: str) -> dict[str, Any]:
    return {"at": "2026-12-01T10:00:00+00:00", "host": "box-1", "cpu_model": cpu, "infervisor": "0.1.0",
            "commit": "abc123def456", "torch": "2.13.0"}  # fmt: skip


def _served(chain: list[str]) -> dict[str, Any]:
    return {"chain": chain, "workers": 2, "cores_per_worker": 1, "profiles": [chain[0]] * 2, "checked_on": []}


def _optimize(cpu: str, dry_run: bool) -> dict[str, Any]:
    """optimize --json as the command writes it: int8_static on 2x1, checked through a daemon at 40 QPS."""
    row = {"cosine": 0.9999999999995801, "max_abs_error": 0.001, "rss_mb": 300.4, "checked_on": "seeded random inputs",
           "layout": "2x1"}  # fmt: skip
    rows = [
        {**row, "profile": "int8_static", "p50_ms": 1.0, "p99_ms": 2.0, "qps": 118.4932, "cold_start_s": 55.3,
         "restart_s": 1.54, "risk": "calibration"},
        {**row, "profile": "jit", "p50_ms": 1.5, "p99_ms": 3.0, "qps": 90.0, "cold_start_s": 2.1, "risk": ""},
        {**row, "profile": "eager", "cosine": 1.0, "p50_ms": 2.0, "p99_ms": 4.0, "qps": 60.0, "cold_start_s": 1.8,
         "risk": ""},
    ]  # fmt: skip
    check = {"qps": 40.0, "clients": 2, "seconds": 10.0, "samples": 400, "errors": 0, "p50_ms": 3.1, "p99_ms": 7.25,
             "saturated_qps": 101.0, "profiles": ["int8_static", "int8_static"]}  # fmt: skip
    return {
        "model": "tiny", "rows": rows, "layouts": [], "chain": CHOSEN, "layout": {"workers": 2, "cores_per_worker": 1},
        "check": check, "auto_pick": {}, "verdict": {"met": True, "profile": "int8_static", "reasons": [],
                                                     "layout": "2x1"},
        "written_to": None if dry_run else WRITTEN,
        "not_written": f"--dry-run: the diff was shown, {WRITTEN} was left unchanged" if dry_run else None,
        "command": "infervisor optimize --model tiny --constraints c.json --json opt.json", "seconds": 2.0,
        "measured_on": _measured_on(cpu),
    }  # fmt: skip


def _probe(cpu: str, chain: list[str]) -> dict[str, Any]:
    stages = {s: {"p50_ms": 0.1, "p99_ms": 0.2, "p99.9_ms": 0.3} for s in (*STAGES, "round_trip")}
    return {
        "model": "tiny", "qps": 20.0, "clients": 2, "batch": 1, "duration_s": 10.0, "samples": 200, "errors": 0,
        "stages": stages, "verdict": "model (worker: forward pass) takes 80% of the median round trip",
        "counters": {"available": False, "why": "perf is not installed"}, "operators": None,
        "profiled_pid": 101, "profiled_requests": 0, "round_trip_ms": [0.1 * (i % 7 + 1) for i in range(200)],
        "command": "infervisor probe --model tiny --qps 20 --json probe.json", "measured_on": _measured_on(cpu),
        "served": _served(chain),
    }  # fmt: skip


def _harden(cpu: str, soak_passed: bool) -> dict[str, Any]:
    series = [{"t_s": t, "p99_ms": 0.2 + t / 10, "rss_mb": {"101": 300.0 + t, "102": 301.0}, "max_abs_drift": 0.0}
              for t in (4, 8, 12, 16, 20)]  # fmt: skip
    results = [
        {"name": "polluted input", "passed": True, "detail": "clear errors", "numbers": {}, "measured": True},
        {"name": "soak", "passed": soak_passed, "measured": True,
         "detail": "5 samples over 20 s: worst interval P99 52.31 ms (limit 40)" if not soak_passed else "ok",
         "numbers": {"seconds": 20.0, "clients": 2, "series": series}},
        {"name": "thermal/frequency", "passed": False, "measured": False,
         "detail": "not measured: no thermal zones or cpufreq readable on this box", "numbers": {}},
    ]  # fmt: skip
    return {"model": "tiny", "duration_s": 60.0, "command": "infervisor harden --model tiny --duration 60",
            "measured_on": _measured_on(cpu), "served": _served(CHOSEN), "results": results}  # fmt: skip


def _tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    entry = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
    path.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"tiny": entry}}, indent=2) + "\n")
    return path


def _constraints(tmp_path: Path, cpu: str) -> Path:
    raw = json.loads(EXAMPLE.read_text())
    raw["hardware"]["cpu_model"] = cpu
    path = tmp_path / "constraints.json"
    path.write_text(json.dumps(raw))
    return path


def _report(tmp_path: Path, target_cpu: str, **documents: Any) -> tuple[subprocess.CompletedProcess[str], str]:
    """`infervisor report` on the tiny config with these JSON documents; the process and the page."""
    argv = ["--config", str(_tiny_config(tmp_path)), "--constraints", str(_constraints(tmp_path, target_cpu))]
    for name, document in documents.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        argv += [f"--{name}", str(path)]
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "report", *argv, "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert out.exists(), done.stdout + done.stderr
    return done, out.read_text()


def _heading(page: str) -> str:
    return page[page.index("<h1") : page.index("</h1>")]


def _not_proven(page: str) -> list[str]:
    section = page[page.index("<ul class=not-proven>") :]
    return re.findall(r"<li>(.*?)</li>", section[: section.index("</ul>")])


def _met_documents(here: str) -> dict[str, Any]:
    return {"optimize": _optimize(here, dry_run=False), "probe": _probe(here, CHOSEN),
            "harden": _harden(here, soak_passed=True)}  # fmt: skip


def test_met_names_the_choice_and_still_lists_what_it_does_not_prove(tmp_path: Path) -> None:
    """Every part on the target CPU and chain: "SLA met" (exit 0), and the short soak, the empty profiler, the
    synthetic accuracy, the unmeasured thermal check and the first-start cold start are listed as not proven."""
    here = cpu_model()
    done, page = _report(tmp_path, here, **_met_documents(here))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: SLA met, by profile int8_static (chain int8_static → jit → eager) on 2 workers × 1 core each" in (
        _heading(page)
    )
    assert "written to /etc/infervisor/config.json" in page
    not_proven = _not_proven(page)
    assert any("the soak ran 20 s against an uptime target of 720 h" in n for n in not_proven), not_proven
    assert any(n.startswith("operators: probe&#x27;s torch.profiler returned no report") for n in not_proven)
    assert any("int8_static change numerics and were judged on seeded random inputs" in n for n in not_proven)
    assert any(n.startswith("thermal/frequency: not measured") for n in not_proven)
    assert (
        "cold start: a first start (nothing compiled or cached yet) takes int8_static 55.3 s, over the 5000 ms "
        "constraint; int8_static meet it only on a restart that loads the cached compiled package" in not_proven
    )
    # One promise per figure: what each number is, rounded as the CLI prints it, and how to repeat it.
    assert "QPS, total of 2 workers × 1 core each" in page and "P99 ms, 1 worker, in process" in page
    assert "40 QPS offered by 2 clients for 10 s" in page and "20 QPS offered by 2 clients for 10 s" in page
    # The check's daemon is gone: its load is offered for the served daemon, not as a Repeat of a step.
    program = shlex.join(infervisor_command())  # the infervisor that made the report: runnable, not a bare name
    assert ("The check's load against the daemon serving the written config: <code>" + program + " probe --model "
            "tiny --qps 40 --clients 2 --duration 10 --runtime-dir YOUR_DAEMONS_RUNTIME_DIR</code>") in page
    assert "Repeat: <code>infervisor harden --model tiny --duration 60</code>" in page
    for unrounded in ("118.4932", "0.9999999999995801", "5000.0", "300.4"):
        assert unrounded not in page
    assert "✓ 118.5" in page and "✓ 1.000000000000 (seeded random inputs)" in page and "✗ 55.3" in page
    jit = page[page.index("<tr><td>jit</td>") :].split("</tr>")[0]
    assert "✓ 2.1</td>" in jit.split("<td>")[-3], jit  # restart of a non-packaged profile is its first start
    # Identity: a signed copy can be matched to what runs.
    for field in ("report made", "CPU model (this box)", "infervisor", "torch", "sha256", "optimize measured"):
        assert field in page
    assert page.count("<img") == 3 and len(list(tmp_path.glob("report-*.png"))) == 3


def test_not_met_lists_the_failed_figures_with_their_numbers(tmp_path: Path) -> None:
    """A failed soak makes the SLA not met (exit 1), with the soak's own figures in the verdict."""
    here = cpu_model()
    documents = {**_met_documents(here), "harden": _harden(here, soak_passed=False)}
    done, page = _report(tmp_path, here, **documents)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VERDICT: SLA not met" in _heading(page)
    verdict = page[page.index("</h1>") : page.index("<h2>")]
    assert "harden: soak failed: 5 samples over 20 s: worst interval P99 52.31 ms (limit 40)" in verdict
    assert "thermal" not in verdict  # not measured is neither passed nor failed
    assert "<td>thermal/frequency</td><td>not measured</td>" in page


def test_unproven_says_what_is_missing_and_that_a_dry_run_wrote_nothing(tmp_path: Path) -> None:
    """Harden not run, a dry run, a probe of another chain and another CPU: "SLA unproven" (exit 3), each named."""
    measured_cpu = "Example Corp Edge CPU E-100"  # a name no test box has, so the rule is seen on every CPU
    documents = {"optimize": _optimize(measured_cpu, dry_run=True), "probe": _probe(measured_cpu, SERVED_BY_DEFAULT)}
    done, page = _report(tmp_path, TARGET_CPU, **documents)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "VERDICT: SLA unproven" in _heading(page)
    verdict = page[page.index("</h1>") : page.index("<h2>")]
    assert "harden was not run: stability" in verdict
    assert "probe measured a daemon serving int8_static → jit_onednn → eager on 2 workers × 1 core each" in verdict
    # The doctor part always runs on this box, so its CPU joins the one the documents name unless it is the target.
    others = ", ".join(sorted({measured_cpu, cpu_model()} - {TARGET_CPU}))
    assert f"the figures come from {others}; the constraints name {TARGET_CPU}" in verdict
    assert "Nothing was written: --dry-run: the diff was shown" in verdict
    assert "written to" not in verdict and "Fallback chain written" not in page
    # Without harden there is no soak to draw: only the latency chart.
    assert page.count("<img") == 1 and [p.name for p in tmp_path.glob("report-*.png")] == ["report-latency.png"]
    assert "SLA unproven" in done.stdout and "missing: harden was not run" in done.stdout


def test_unreadable_thermal_sensors_are_not_measured_not_passed(tmp_path: Path) -> None:
    """A daemon whose thermal reading is empty gives a thermal check that is neither passed nor measured."""

    class NoSensors(Target):
        def status(self) -> dict[str, Any]:
            return {"thermal": {"max_temp_c": None, "freq_mhz": None, "throttle_events": None}}

    result = check_thermal(NoSensors(tmp_path, "ipc://none", "tiny", {}), {})
    assert (result.passed, result.measured) == (False, False) and result.detail.startswith("not measured")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGE_WIDTH_PX = 1280

#: Run after load: write each image's natural and rendered width, and the page's, into the DOM that is dumped.
_MEASURE = """<script>
addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'measured';
  out.textContent = JSON.stringify({page: document.documentElement.clientWidth,
    scroll: document.documentElement.scrollWidth,
    images: [...document.images].map(i => ({natural: i.naturalWidth, rendered: i.getBoundingClientRect().right}))});
  document.body.appendChild(out);
});
</script>"""


def _chromium(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *argv],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


@pytest.mark.daemon  # a headless Chromium render and print (not the fast tier)
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary: apt-get install -y chromium poppler-utils")
def test_the_page_fits_1280_px_and_prints_in_a_real_browser(tmp_path: Path) -> None:
    """Headless Chromium at 1280 px: no image wider than the page, nothing scrolls sideways; printed to PDF (Letter),
    every chart is in it and none is wider than the paper."""
    pytest.importorskip("matplotlib")
    here = cpu_model()
    done, page = _report(tmp_path, here, **_met_documents(here))
    assert done.returncode == 0, done.stdout + done.stderr
    measured_page = tmp_path / "measured.html"
    measured_page.write_text(page + _MEASURE)
    dumped = _chromium(f"--window-size={PAGE_WIDTH_PX},900", "--virtual-time-budget=5000", "--dump-dom",
                       measured_page.as_uri())  # fmt: skip
    found = re.search(r'<pre id="measured">(.*?)</pre>', dumped.stdout, re.S)
    assert found, dumped.stdout[-2000:] + dumped.stderr[-2000:]
    widths = json.loads(found.group(1).replace("&quot;", '"'))
    assert len(widths["images"]) == 3 and all(i["natural"] > 0 for i in widths["images"]), widths
    assert all(i["rendered"] <= widths["page"] for i in widths["images"]), widths
    assert widths["scroll"] <= widths["page"], widths
    screenshot = tmp_path / "report.png"
    shot = _chromium(f"--window-size={PAGE_WIDTH_PX},2400", f"--screenshot={screenshot}",
                     (tmp_path / "report.html").as_uri())  # fmt: skip
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]
    pdf = tmp_path / "report.pdf"
    printed = _chromium("--no-pdf-header-footer", f"--print-to-pdf={pdf}", (tmp_path / "report.html").as_uri())
    assert pdf.exists() and pdf.read_bytes()[:5] == b"%PDF-", printed.stderr[-2000:]
    pdfimages, pdfinfo = shutil.which("pdfimages"), shutil.which("pdfinfo")
    assert pdfimages and pdfinfo, "the PDF check needs poppler-utils: apt-get install -y poppler-utils"
    info = subprocess.run([pdfinfo, str(pdf)], capture_output=True, text=True, check=True).stdout
    paper_pt = float(re.search(r"Page size:\s+([\d.]+) x", info).group(1))  # type: ignore[union-attr]
    listing = subprocess.run([pdfimages, "-list", str(pdf)], capture_output=True, text=True, check=True).stdout
    images = [line.split() for line in listing.splitlines()[2:] if line.split() and line.split()[2] == "image"]
    assert len(images) == 3, listing
    for image in images:
        width_px, x_ppi = float(image[3]), float(image[12])
        assert width_px / x_ppi * 72 <= paper_pt, listing  # the width the image is drawn at, in points
