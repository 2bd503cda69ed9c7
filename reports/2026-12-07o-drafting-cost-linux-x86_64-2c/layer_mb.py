import time, torch
from specula.runtime.bench.served import _load
from specula.runtime.bench.spec import make_drafter
from specula.drafters import lean_llama
import os; torch.set_num_threads(int(os.environ.get("NT", "2")))
target, proc = _load("target")
d = make_drafter({"kind": "text_lm"}, target, proc.tokenizer)
body = d._body
layer = body.layers[0]
print(type(d._kv._make_cache() if hasattr(d._kv, "_make_cache") else None), body.config.hidden_size, body.config.num_hidden_layers)
cache = d._kv.new_cache()
S = 300
H = body.config.hidden_size
x0 = torch.randn(1, S, H)
pos = torch.arange(S)[None]
mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
with torch.no_grad():
    lean_llama.model_forward(body, mask, pos, cache, inputs_embeds=x0, int8=d._int8)
    print(type(cache.layers[0]))
    x = torch.randn(1, 1, H)
    def step(n):
        cos, sin = lean_llama.rope_tables(body.rotary_emb, torch.tensor([[S]]), x.dtype)
        m = torch.ones(1, 1, 1, S + n + 1, dtype=torch.bool)
        return cos, sin, m
    for rep in range(3):
        for i in range(2):
            for lay in body.layers[:2]: lay.self_attn.layer_idx
        N = 200
        t = 0.0
        for n in range(N):
            cos, sin, m = step(n)
            t0 = time.perf_counter()
            lean_llama.decoder_layer(layer, x, m, cos, sin, cache, 0, d._int8)
            t += time.perf_counter() - t0
            for l in cache.layers[1:]: pass
        print("decoder_layer us", round(1e6 * t / N, 1))
        cache.crop(S) if hasattr(cache, "crop") else None
        for l in cache.layers: l.crop(-N) if False else None
