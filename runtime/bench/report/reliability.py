"""The reliability section of ``specula bench report --reliability``: the reliability and security suite, run by
pytest in a child process from the repository root, and the figure each of its tests records.

Each test of the suite prints one figure ("1000/1000 malformed requests rejected, ... RSS +12 MiB") through
``record_figure`` (below; the tests reach it through their kits), which also appends ``{"test", "line",
"numbers"}`` as a JSON line to the file named by $SPECULA_FIGURES_OUT. Here that file lives in the report folder
(``<report>/reliability/figures.jsonl``, next to pytest's junit XML and its full output); the section reads the
lines back and joins them with each test's outcome from the junit XML.

Why a child process: the suite starts servers, Ray and threads of its own and must not share this process's torch
settings or state; a timeout kills its whole process group (Ray workers included). The tests live in the checkout,
not in the package: from an installed wheel the section is "not measured: tests not found". A failing test does
not fail the report: the section is "failed" with pytest's counts and the tail of its output, and still carries
the figures and outcomes it got. ``SPECULA_LONG=1`` in the environment passes through (the suite's long variants).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FIGURES_ENV = "SPECULA_FIGURES_OUT"  # the file record_figure appends to; set for the child pytest by run_suite


def _plain(x):
    """JSON for what a figure's numbers may hold besides ints/floats/strings: tensors' and numpy's scalars."""
    return x.item() if hasattr(x, "item") else str(x)


def record_figure(name: str, line: str, **numbers) -> None:
    """Print a test's figure (``line``, shown with ``pytest -s`` and in the report) and, when $SPECULA_FIGURES_OUT
    names a file, append ``{"test": name, "line": line, "numbers": {...}}`` to it as one JSON line.

    ``name``: the test function's name, or a parametrized case's full name (``test_x[a]``); the report joins it
    with pytest's junit outcome (``_results``). One ``os.write`` on an O_APPEND descriptor: figures of concurrent
    writers (pytest-xdist workers, several test files) land as whole lines.
    """
    print(f"\n{line}")
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    record = json.dumps({"test": name, "line": line, "numbers": numbers}, default=_plain, sort_keys=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (record + "\n").encode())
    finally:
        os.close(fd)


DEFAULT_TESTS = (  # relative to the repository root; pytest node ids are fine
    "tests/reliability",
    "tests/serve/test_faults.py",
    "tests/wire/test_wire_protos_build.py::test_no_pickle_on_the_wire",
    # backpressure, deadlines and auth on both doors (they live with their API's tests)
    "tests/serve/test_openai_http.py::test_auth_on_every_route",
    "tests/serve/test_openai_http.py::test_backpressure_then_disconnect_frees_the_request",
    "tests/serve/test_openai_http.py::test_timeout_is_408_and_cancels_the_generation",
    "tests/serve/test_grpc_api.py::test_every_method_needs_a_valid_token",
    "tests/serve/test_grpc_api.py::test_backpressure_is_resource_exhausted",
    "tests/serve/test_grpc_api.py::test_deadline_exceeded_frees_the_request",
)
TAIL_LINES = 40


def repo_root() -> Path | None:
    """The checkout this package runs from (an editable install maps ``specula.runtime`` to ``<root>/runtime``), or
    None when there is no ``tests`` folder beside it (an installed wheel)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "tests").is_dir() and (root / "pyproject.toml").is_file() else None


def read_figures(path: Path) -> tuple[list[dict], int]:
    """The figures recorded in ``path`` (JSON lines), and how many lines were not a figure (a test killed while
    writing, or anything else that is not ``{"test": str, "line": str, "numbers": dict}``)."""
    figures, bad = [], 0
    if not path.is_file():
        return figures, bad
    for raw in path.read_text(errors="replace").splitlines():
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("test"), str) and isinstance(rec.get("line"), str):
            figures.append({"test": rec["test"], "line": rec["line"], "numbers": rec.get("numbers") or {}})
        else:
            bad += 1
    return figures, bad


def read_junit(path: Path) -> list[dict]:
    """One row per test case of pytest's junit XML: name, file (dotted), outcome, seconds, message."""
    if not path.is_file():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    rows = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "").strip()
                break
        rows.append({"test": case.get("name", ""), "file": case.get("classname", ""), "outcome": outcome,
                     "seconds": round(float(case.get("time") or 0.0), 2), "message": message[:500]})
    return rows


def _results(cases: list[dict], figures: list[dict]) -> list[dict]:
    """Every test case with the figure lines it recorded (joined on the case's full name, ``test_x[a]``, when it
    recorded under it; else on the function name, so a parametrized case owns ``test_x``'s figures), then figures
    no case claims (junit missing: a timeout)."""
    claimed = set()
    out = []
    for c in cases:
        base = c["test"].split("[", 1)[0]
        own = [f["line"] for f in figures if f["test"] == c["test"]]
        lines = own or [f["line"] for f in figures if f["test"] == base]
        claimed.update((c["test"], base))
        out.append({**c, "figures": lines})
    for f in figures:
        if f["test"] not in claimed:
            out.append({"test": f["test"], "file": "", "outcome": None, "seconds": None, "message": "",
                        "figures": [f["line"]]})
            claimed.add(f["test"])
    return out


def _tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    if not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()[-n:]


def run_suite(root: Path, tests=DEFAULT_TESTS, report_dir: Path | str = ".", timeout_s: float = 3600.0,
              python: str = sys.executable) -> dict:
    """Run ``pytest tests`` from ``root`` with $SPECULA_FIGURES_OUT in ``<report_dir>/reliability/``; return the
    section's JSON (status ok / not_measured / failed, counts, figures, one result per test)."""
    root, report_dir = Path(root), Path(report_dir).resolve()  # pytest runs in root: paths must be absolute
    present = [t for t in tests if (root / t.split("::", 1)[0]).exists()]
    absent = [t for t in tests if t not in present]
    if not present:
        return {"status": "not_measured", "reason": f"tests not found under {root}: {', '.join(tests)}"}
    work = report_dir / "reliability"
    work.mkdir(parents=True, exist_ok=True)
    figures_path, junit_path, log_path = work / "figures.jsonl", work / "junit.xml", work / "pytest.log"
    for p in (figures_path, junit_path):  # a re-run into the same folder starts afresh
        p.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit_path}", *present]
    env = {**os.environ, FIGURES_ENV: str(figures_path)}
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # own group: kill Ray workers too
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        finally:
            if proc.poll() is None:  # timed out, or this process was interrupted: leave nothing running
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    figures, bad = read_figures(figures_path)
    cases = read_junit(junit_path)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    rel = lambda p: os.path.relpath(p, report_dir)  # noqa: E731  (paths in the JSON are relative to the report)
    out = {"status": "ok", "command": " ".join(["python -m pytest -q -p no:cacheprovider", *present]),
           "root": str(root), "tests": present, "missing_tests": absent, "timeout_s": timeout_s, "exit_code": rc,
           "counts": counts, "figures": figures, "bad_figure_lines": bad, "results": _results(cases, figures),
           "files": {"figures": rel(figures_path), "junit": rel(junit_path), "log": rel(log_path)}}
    if timed_out:
        out.update(status="failed", reason=f"timed out after {timeout_s:.0f} s (pytest and its children killed)")
    elif rc != 0:
        what = ", ".join(f"{v} {k}" for k, v in counts.items() if v and k != "passed") or "no test result"
        out.update(status="failed", reason=f"pytest exit code {rc}: {what} of {len(cases)} test(s)")
    elif absent:
        out["note"] = f"not found, not run: {', '.join(absent)}"
    if out["status"] != "ok":
        out["tail"] = _tail(log_path)
    return out
