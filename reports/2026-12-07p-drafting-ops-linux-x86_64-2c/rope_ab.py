import torch, time, ast, subprocess
torch.set_num_threads(2)
from specula.drafters import lean_llama as LL
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
src = subprocess.check_output(["git", "-C", "/work/main", "show", "HEAD:drafters/lean_llama.py"]).decode()
fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "rope_tables")
ns = dict(vars(LL)); exec(compile(ast.Module([fn], []), "old", "exec"), ns); old = ns["rope_tables"]
rot = LlamaRotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=4))
pos = torch.tensor([[300]])
def tm(f, n=5000):
    t = time.perf_counter()
    for _ in range(n): f(rot, pos, torch.float32)
    return (time.perf_counter() - t) / n * 1e6
for f in (old, LL.rope_tables): tm(f)
r = {"old": [], "new": []}
for _ in range(6):
    r["old"].append(round(tm(old), 2)); r["new"].append(round(tm(LL.rope_tables), 2))
print(r)
