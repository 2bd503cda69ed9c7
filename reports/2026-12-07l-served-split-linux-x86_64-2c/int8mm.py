import torch, time
torch.set_num_threads(2)
from specula.drafters.int8_weights import quantize
for (n, k) in [(768, 256), (256, 256), (1536, 256), (256, 768), (985, 256)]:
    w = torch.randn(n, k); q = quantize(w)
    x = torch.randn(1, k)
    def t(f, reps=2000):
        for _ in range(50): f()
        a = time.perf_counter()
        for _ in range(reps): f()
        return (time.perf_counter() - a) / reps * 1e6
    bf = t(lambda: q(x))
    raw_bf = t(lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q.weight, q.scales))
    xb = x.to(torch.bfloat16)
    raw_only = t(lambda: torch._weight_int8pack_mm(xb, q.weight, q.scales))
    try:
        f32 = t(lambda: torch._weight_int8pack_mm(x, q.weight, q.scales.float()))
    except Exception as e:
        f32 = f"err {type(e).__name__}"
    lin = t(lambda: torch.nn.functional.linear(x, w))
    print(f"[{n},{k}] Int8Weight {bf:.1f} us, raw+cast {raw_bf:.1f}, kernel only {raw_only:.1f}, fp32 act {f32 if isinstance(f32,str) else round(f32,1)}, F.linear fp32 {lin:.1f}")
