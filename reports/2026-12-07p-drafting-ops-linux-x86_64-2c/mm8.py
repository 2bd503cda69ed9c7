import torch, time
torch.set_num_threads(2)
from specula.drafters.int8_weights import quantize
for N, K in [(768, 256), (256, 256), (2048, 256), (256, 1024), (985, 256)]:
    w = torch.randn(N, K); q = quantize(w)
    s32 = q.scales.float()
    x = torch.randn(1, 1, K)
    xb = x.reshape(-1, K).to(torch.bfloat16)
    def a(): return q(x)
    def b(): return torch._weight_int8pack_mm(x.reshape(-1, K), q.weight, s32)
    def c(): return torch._weight_int8pack_mm(xb, q.weight, q.scales)
    def d(): return torch.nn.functional.linear(x, w)
    res = {}
    for name, f in [("wrap bf16", a), ("fp32 direct", b), ("bf16 kernel only", c), ("fp32 linear", d)]:
        for _ in range(200): f()
        ts = []
        for r in range(5):
            t = time.perf_counter()
            for _ in range(1000): f()
            ts.append((time.perf_counter() - t) * 1e3)
        res[name] = round(min(ts), 2)
    err = (b().reshape(1,1,N) - a()).abs().max().item()
    print(N, K, res, "us per call; fp32 vs bf16 maxdiff", round(err, 4))
