"""Smoke test of the codec micro-benchmark (the real runs are for the report, not for CI)."""

from __future__ import annotations

from specula.runtime.bench.wire import bench_codecs, main


def test_bench_codecs_reports_bytes_times_and_errors():
    res = bench_codecs([(4, 64), (2, 2, 8, 16)], ["fp32", "int8+zstd"], repeats=1)
    assert set(res) == {"fp32", "int8+zstd"} and set(res["fp32"]) == {"4x64", "2x2x8x16"}
    exact, lossy = res["fp32"]["4x64"], res["int8+zstd"]["4x64"]
    assert exact["wire_bytes"] == exact["raw_bytes"] == 4 * 64 * 4 and exact["max_abs_err"] == 0.0
    assert lossy["wire_bytes"] < exact["wire_bytes"] and 0 < lossy["max_rel_err"] < 1 / 127
    assert all(r["encode_ms"] >= 0 and r["decode_ms"] >= 0 for by in res.values() for r in by.values())


def test_bench_cli_prints_a_table(capsys):
    assert main(["--shapes", "8x16", "--codecs", "fp16", "--repeats", "1"]) == 0
    assert "fp16" in capsys.readouterr().out
