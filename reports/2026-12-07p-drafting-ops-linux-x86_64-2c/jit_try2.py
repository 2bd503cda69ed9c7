import torch, time, warnings
import torch.nn.functional as F
torch.set_num_threads(2)
from specula.drafters import lean_llama as LL
from specula.drafters.int8_weights import quantize

def pre_attn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             nq: int, nk: int, d: int, floor: float):
    b, t = x.size(0), x.size(1)
    h = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(floor)
    y = torch._weight_int8pack_mm(h.reshape(-1, h.size(-1)).to(torch.bfloat16), w, s).to(x.dtype)
    y = y.reshape(b, t, -1)
    qk, v = y.split([nq + nk, y.size(-1) - nq - nk], dim=-1)
    qk = qk.reshape(b, t, -1, d).transpose(1, 2)
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
    q, k = qk.split([nq // d, nk // d], dim=1)
    v = v.reshape(b, t, -1, d).transpose(1, 2)
    return q, k, v

def post_attn(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              ow: torch.Tensor, os_: torch.Tensor, guw: torch.Tensor, gus: torch.Tensor, dw: torch.Tensor,
              ds: torch.Tensor, floor: float):
    b, t = x.size(0), x.size(1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.transpose(1, 2).reshape(b * t, -1)
    x = x + torch._weight_int8pack_mm(o.to(torch.bfloat16), ow, os_).to(x.dtype).reshape(b, t, -1)
    h = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(floor)
    gu = torch._weight_int8pack_mm(h.reshape(b * t, -1).to(torch.bfloat16), guw, gus)
    g, u = gu.chunk(2, dim=-1)
    m = F.silu(g) * u
    return x + torch._weight_int8pack_mm(m, dw, ds).to(x.dtype).reshape(b, t, -1)

import os
if os.environ.get("JIT"):
    pre_attn = torch.jit.script(pre_attn); post_attn = torch.jit.script(post_attn)
from transformers import LlamaConfig, LlamaForCausalLM
from specula.targets.kv import growable_cache
cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=985, attn_implementation="sdpa")
model = LlamaForCausalLM(cfg).eval()
body = model.model
layer = body.layers[0]
p = LL.packed(layer)

def step_lean(x, mask, cos, sin, cache):
    return LL.decoder_layer(layer, x, mask, cos, sin, cache, 0, True)
def step_jit(x, mask, cos, sin, cache):
    p = LL.packed(layer)
    q, k, v = pre_attn(x, cos, sin, p.qkv.weight, p.qkv.scales, p.split[0], p.split[1], 64, p.floors[0])
    k, v = cache.update(k, v, 0)
    return post_attn(x, q, k, v, mask, layer.self_attn.scaling, p.o.weight, p.o.scales, p.gate_up.weight,
                     p.gate_up.scales, p.down.weight, p.down.scales, p.floors[1])

for B, T in [(1, 1), (2, 3), (1, 5)]:
    for name, f in [("lean", step_lean), ("jit", step_jit)]:
        torch.manual_seed(0)
        S = 300
        cache = growable_cache(cfg)
        k0 = torch.randn(B, 4, S, 64); cache.update(k0, k0.clone(), 0)
        x = torch.randn(B, T, 256)
        pos = torch.arange(S, S + T).expand(B, T)
        cos, sin = LL.rope_tables(body.rotary_emb, pos, torch.float32)
        mask = torch.ones(B, 1, T, S + T, dtype=torch.bool)
        with torch.no_grad():
            out = f(x, mask, cos, sin, cache)
            for _ in range(30):  # warm (jit profiling runs)
                c2 = growable_cache(cfg); c2.update(k0, k0.clone(), 0); f(x, mask, cos, sin, c2)
            ts = []
            for r in range(5):
                c2 = growable_cache(cfg); c2.update(k0, k0.clone(), 0)
                t0 = time.perf_counter()
                for _ in range(200):
                    c2.layers[0].crop(-T) if False else None
                    f(x, mask, cos, sin, c2) if False else None
                ts.append(0)
            # time with a cache that grows (crop back every step)
            c2 = growable_cache(cfg); c2.update(k0, k0.clone(), 0)
            best = 1e9
            for r in range(5):
                t0 = time.perf_counter()
                for _ in range(300):
                    f(x, mask, cos, sin, c2); c2.crop(-T)
                best = min(best, (time.perf_counter() - t0) / 300 * 1e6)
        globals().setdefault("ref", {})[(B, T, name)] = out
        print(B, T, name, round(best, 1), "us")
    print("  maxdiff", (ref[(B, T, "lean")] - ref[(B, T, "jit")]).abs().max().item())
c2 = growable_cache(cfg); c2.update(k0, k0.clone(), 0)
kk = torch.randn(1, 4, 5, 64)
t0 = time.perf_counter()
for _ in range(300):
    c2.update(kk, kk, 0); c2.crop(-5)
print("update+crop us", (time.perf_counter() - t0) / 300 * 1e6)
