import torch, time
torch.set_num_threads(2)
from specula.drafters import lean_llama as LL
from specula.runtime.bench.served import _load
from specula.runtime.bench.spec import make_drafter
target, proc = _load("target")
d = make_drafter({"kind": "text_lm"}, target, proc.tokenizer)
body = d._body
S = 300
pos = torch.tensor([[S]]); ids = torch.tensor([[5]])
x = body.embed_tokens(ids)
def tm(f, n=3000):
    for _ in range(300): f()
    best = 1e9
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return round(best, 2)
print("rope_tables", tm(lambda: LL.rope_tables(body.rotary_emb, pos, torch.float32)))
print("embed module", tm(lambda: body.embed_tokens(ids)))
print("F.embedding", tm(lambda: torch.nn.functional.embedding(ids, body.embed_tokens.weight)))
print("final rms_norm", tm(lambda: LL.rms_norm(body.norm, x)))
print("config n layers", tm(lambda: body.config.num_hidden_layers))
print("layers iter", tm(lambda: list(body.layers._modules.values())))
print("head", tm(lambda: d._head(x[:, 0])))
print("head float", tm(lambda: d._head(x[:, 0]).float()))
