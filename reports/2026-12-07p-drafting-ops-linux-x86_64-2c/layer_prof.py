import torch, time
from torch.profiler import profile, ProfilerActivity
torch.set_num_threads(2)
from specula.drafters import lean_llama as LL
from specula.runtime.bench.served import _load
from specula.runtime.bench.spec import make_drafter
target, proc = _load("target")
d = make_drafter({"kind": "text_lm"}, target, proc.tokenizer)
body = d._body
from specula.targets.kv import growable_cache
cfg = body.config
layer = body.layers[0]
S = 300
cache = growable_cache(cfg)
k0 = torch.randn(1, cfg.num_key_value_heads, S, 64); cache.update(k0, k0.clone(), 0)
x = torch.randn(1, 1, cfg.hidden_size)
pos = torch.tensor([[S]])
cos, sin = LL.rope_tables(body.rotary_emb, pos, torch.float32)
mask = torch.ones(1, 1, 1, S + 1, dtype=torch.bool)
def step():
    LL.decoder_layer(layer, x, mask, cos, sin, cache, 0, True); cache.crop(-1)
with torch.no_grad():
    for _ in range(300): step()
    for r in range(3):
        t0 = time.perf_counter()
        for _ in range(1000): step()
        print("us per layer step (+crop)", round((time.perf_counter() - t0) * 1e3, 1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(200): step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
