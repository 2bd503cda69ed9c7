import torch, time, statistics, sys
torch.set_num_threads(2)
def bench(f, reps=200):
    for _ in range(20): f()
    ts = []
    for _ in range(reps):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6
for shape in [(1024, 384), (985, 384)]:
    w = torch.randn(*shape)
    for hint in (1, 8, 158):
        pw = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        row = [f"{shape} hint{hint}"]
        for M in (1, 2, 6, 9, 16, 158, 600):
            x = torch.randn(M, shape[1])
            d = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""))
            row.append(f"M{M} mkl:{bench(lambda: torch.nn.functional.linear(x, w)):.1f} dnn:{d:.1f}")
        print(" | ".join(row))
    x = torch.randn(1, 6, shape[1])
    print("3d ok", torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "").shape)
    xb = torch.randn(6, shape[1]).bfloat16()
    try:
        pwb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 6)
        print("bf16 mkl", bench(lambda: torch.nn.functional.linear(xb, w.bfloat16())), "dnn", bench(lambda: torch.ops.mkldnn._linear_pointwise(xb, pwb, None, "none", [], "")))
    except Exception as e: print("bf16", e)
