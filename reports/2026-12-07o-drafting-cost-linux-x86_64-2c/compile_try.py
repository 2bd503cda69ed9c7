import time, torch, torch.nn.functional as F
from specula.runtime.bench.served import _load
from specula.runtime.bench.spec import make_drafter
from specula.drafters import lean_llama
from specula.drafters.lean_llama import packed, rms_norm, _rotate
torch.set_num_threads(2)
target, proc = _load("target")
d = make_drafter({"kind": "text_lm"}, target, proc.tokenizer)
body = d._body; layer = body.layers[0]
p = packed(layer)
attn, mlp = layer.self_attn, layer.mlp
H = 256; D = attn.head_dim
w1, w2, eps = layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.variance_epsilon
def pre(x, cos, sin):
    h = F.rms_norm(x, (H,), w1, eps)
    qkv = torch._weight_int8pack_mm(h.reshape(-1, H).to(torch.bfloat16), p.qkv.weight, p.qkv.scales).to(x.dtype)
    q, k, v = qkv.reshape(1, 1, -1).split(p.split, dim=-1)
    q = q.reshape(1, 1, -1, D).transpose(1, 2); k = k.reshape(1, 1, -1, D).transpose(1, 2); v = v.reshape(1, 1, -1, D).transpose(1, 2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v
def post(x, o):
    o = o.transpose(1, 2).reshape(1, 1, -1)
    x = x + torch._weight_int8pack_mm(o.reshape(-1, H).to(torch.bfloat16), p.o.weight, p.o.scales).to(x.dtype).reshape(1, 1, H)
    h = F.rms_norm(x, (H,), w2, eps)
    gu = torch._weight_int8pack_mm(h.reshape(-1, H).to(torch.bfloat16), p.gate_up.weight, p.gate_up.scales).to(x.dtype)
    g, u = gu.chunk(2, dim=-1)
    dn = torch._weight_int8pack_mm((F.silu(g) * u).to(torch.bfloat16), p.down.weight, p.down.scales).to(x.dtype)
    return x + dn.reshape(1, 1, H)
x = torch.randn(1, 1, H)
cos, sin = lean_llama.rope_tables(body.rotary_emb, torch.tensor([[300]]), x.dtype)
o = torch.randn(1, 4, 1, D)
def t(f, *a, n=2000):
    for _ in range(50): f(*a)
    t0 = time.perf_counter()
    for _ in range(n): f(*a)
    return round(1e6 * (time.perf_counter() - t0) / n, 1)
with torch.no_grad():
    print("eager pre", t(pre, x, cos, sin), "post", t(post, x, o))
    t0 = time.perf_counter()
    import torch._inductor.config as ic; ic.cpp_wrapper = True
    cpre = torch.compile(pre, dynamic=False)
    cpost = torch.compile(post, dynamic=False)
    cpre(x, cos, sin); cpost(x, o)
    print("compile s", round(time.perf_counter() - t0, 1))
    print("compiled pre", t(cpre, x, cos, sin), "post", t(cpost, x, o))
    a, b = pre(x, cos, sin), cpre(x, cos, sin)
    print("max diff", max((u - w).abs().max().item() for u, w in zip(a, b)), (post(x, o) - cpost(x, o)).abs().max().item())
