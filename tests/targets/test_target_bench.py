"""bench_target measures every number in one run and leaves the target empty."""

from __future__ import annotations

from specula.runtime.bench.target_timing import bench_target, default_prompts, render_markdown
from specula.targets.packed_linear import available


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
    # the prefill's matmuls: every decoder layer's q, k, v, o, gate, up and down projections, no LM head; FLOPs
    # counted from the layers' weights over both prompts' tokens
    m = result["prefill_matmuls"]
    layers = target.model.config.text_config.num_hidden_layers
    weights = sum(p.numel() for n, p in target.model.named_parameters()
                  if ".layers." in n and "language_model" in n and n.endswith("proj.weight"))
    assert m["linear_layers"] == 7 * layers and m["tokens"] == sum(result["prompt_tokens"])
    assert abs(m["linear_gflop"] - 2 * m["tokens"] * weights / 1e9) < 1e-9
    assert m["linears_alone_ms"] > 0 and m["share_of_prefill"] > 0 and m["prefill_gflops"] > 0
    assert f"in its {7 * layers} linear layers" in text and "of the prefill." in text
    # timed through the kernel the target's linears use (oneDNN on packed weights by default on a CPU)
    assert m["kernel"] == ("oneDNN, packed weights" if target.linears_packed else "F.linear")
    assert result["linears_packed"] == target.linears_packed
    assert (target.linears_packed > 0) == available()  # a CPU target packs by default where oneDNN is there
    assert f"{target.linears_packed} linear layers packed for oneDNN" in text
    assert f"alone ({m['kernel']})" in text


def test_prefill_matmuls_count_flops_and_say_nothing_unmeasured():
    from collections import Counter

    from specula.runtime.bench.prefill_matmuls import describe, linear_flops

    assert linear_flops(Counter({(4, 8): 3, (8, 4): 1}), tokens=10) == 2 * 10 * (4 * 8 * 3 + 8 * 4)
    assert describe(None) is None and describe({"share_of_prefill": None}) is None
