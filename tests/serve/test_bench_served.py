"""``specula bench served`` on a tiny lively LLaVA: it starts real ``specula serve`` processes (the default drafter
and gamma 0), drives them with the openai client at one and two streams, decodes the same prompts in process, and
writes a report whose served answers equal in-process plain decoding token for token (the report's ``exact``)."""

from __future__ import annotations

import argparse
import json

import pytest

from ray_kit import RAY_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_served_reports_both_runtimes_and_equal_answers(model_dir, tmp_path, monkeypatch):
    from specula.runtime.bench import served as bench_served
    from specula.runtime.bench.served import add_arguments, main

    left_running = []  # what round_robin is told to leave running for each runner, per call
    real_round_robin = bench_served.round_robin

    def spy(runners, prompts, streams, apps=None):
        left_running.append(dict(apps or {}))
        return real_round_robin(runners, prompts, streams, apps)

    monkeypatch.setattr(bench_served, "round_robin", spy)

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "report"
    config = tmp_path / "config.yaml"  # a fixed draft length: the adaptive default may choose plain steps here
    config.write_text(json.dumps({"drafter": {"adaptive": False}}))
    args = p.parse_args(["--config", str(config), "--model", str(model_dir), "--suite", "caption", "--suite", "text", "--n", "2",
                         "--max-tokens", "12", "--concurrency", "1", "--concurrency", "2", "--num-cpus", "2",
                         "--threads", "1", "--out", str(out)])
    assert main(args) == 0
    report = json.loads((out / "served.json").read_text())
    keys = {f"{rt}/{cfg}/{s}" for rt in ("in_process", "served") for cfg in ("plain", "default") for s in (1, 2)}
    keys |= {f"beside_ray/{cfg}/1" for cfg in ("plain", "default")}  # in process, the idle plain app's Ray running
    assert set(report["rows"]) == keys
    for key, row in report["rows"].items():  # a request's time outside the engine: one stream only
        assert (row["outside_engine_ms"] is None) == key.endswith("/2"), key
    assert report["rows"]["served/plain/1"]["outside_engine_ms"] > 0  # HTTP, JSON, images, the client
    one, two = left_running  # beside_ray runs (one stream only) keep the plain app's Ray running, not frozen
    assert one["beside_ray/plain/1"] is one["beside_ray/default/1"] is one["served/plain/1"]
    assert "in_process/plain/1" not in one and not any(k.startswith("beside_ray") for k in two)
    for key, row in report["rows"].items():
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0, key
        assert row["exact"], f"{key}: answers differ from in-process plain decoding"
    assert report["rows"]["served/default/1"]["tau"] >= 1.0
    served = report["raw"]["served/default/1"]
    assert len(served) == 4 and all(r["metrics"].get("blocks", 0) > 0 for r in served)
    assert sum(r["metrics"].get("draft_tokens", 0) for r in served) > 0  # the served default drafter drafted
    md = (out / "served.md").read_text()
    assert "| served | default | 1 |" in md and "Time split" in md
    split = md.split("## Where the served time goes")[1]
    assert "| plain |" in split and "| default |" in split, split
    per_suite = md.split("## tokens/s per suite")[1].split("## Speedup per suite")[0]
    assert all(f"| {rt} | {cfg} |" in per_suite for rt in ("in_process", "served") for cfg in ("plain", "default"))
    speedups = md.split("## Speedup per suite")[1]  # default x plain per suite, in process and served
    rows = [line for line in speedups.splitlines() if line.startswith(("| in_process | default |",
                                                                        "| served | default |"))]
    # in process only at one stream (a batch of two has one wall time for both); served at 1 and 2 streams
    assert [line.split(" | ")[:3] for line in rows] == [["| in_process", "default", "1"], ["| served", "default", "1"],
                                                        ["| served", "default", "2"]], speedups
    assert all(line.count("x |") == 2 for line in rows), speedups
    caption = report["rows"]["served/default/2"]["per_suite_tokens_per_s"]["caption"] / \
        report["rows"]["served/plain/2"]["per_suite_tokens_per_s"]["caption"]
    assert f"| served | default | 2 | {caption:.2f}x |" in md
    # the ceilings from the run's own time split, per runtime: one stream over plain, two streams over one
    assert {(c["runtime"], c["compared"]) for c in report["ceilings"]} == {
        (rt, what) for rt in ("in_process", "served") for what in ("default over plain, 1 stream",
                                                                    "default, 2 streams over 1")}
    assert all(c["cap"] > 0 for c in report["ceilings"]) and "## Ceilings" in md
    assert 0 < report["rows"]["in_process/plain/1"]["per_suite_longest_answer"]["caption"] <= 12
