"""bench_target measures every number in one run and leaves the target empty."""

from __future__ import annotations

from specula.runtime.bench.target_timing import bench_target, default_prompts, render_markdown


def test_bench_target_reports_everything(kit):
    target = kit.target()
    result = bench_target(
        target, lambda: default_prompts(target, batch_size=2, text_tokens=8), gammas=range(1, 4), repeats=2,
        warmup=1, prefill_repeats=1,
    )
    params = result["params"]
    assert params["vision_tower"] > 0 and params["projector"] > 0 and params["language_model"] > 0
    assert params["vision_tower"] + params["projector"] + params["language_model"] == params["total"]
    assert result["batch_size"] == 2 and result["decode_ms"] > 0
    assert result["encode_ms"] > 0 and result["prefill_ms"] > 0 and result["prefill_lm_ms"] > 0
    assert [v["gamma"] for v in result["verify"]] == [1, 2, 3]
    assert all(v["ratio"] > 0 for v in result["verify"])
    assert target.live_ids == ()
    text = render_markdown(result)
    assert "verify gamma=3" in text and "T_decode" in text and "vision_tower" in text
