"""``bench_overhead`` runs end to end on the tiny zoo architecture and reports what it promises."""

from __future__ import annotations

from specula.runtime.bench.overhead import render, run


def test_bench_overhead_smoke():
    r = run("tiny", new_tokens=4, gamma=2, rounds=1, steps=2, warmup=0)
    assert r["greedy_exact"] is True
    assert set(r["median_ms"]) == {"hf_generate", "engine_plain", "hf_step1", "decode", "hf_step3", "verify2"}
    assert set(r["ratios"]) == {"engine_plain / hf_generate", "decode / hf_step1", "verify2 / hf_step3",
                                "verify2 / decode"}
    assert all(v > 0 for v in r["ratios"].values())
    assert "engine_plain / hf_generate" in render(r)
