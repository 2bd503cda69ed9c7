import sys, time, torch, ast, subprocess
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.drafters import lean_llama, text_lm
torch.set_num_threads(2)
def old_fn(path, mod, name, cls=None):
    src = subprocess.check_output(["git", "-C", "/work/main", "show", f"{sys.argv[2]}:{path}"]).decode()
    body = ast.parse(src).body
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = dict(vars(mod)); exec(compile(ast.Module([fn], []), "old", "exec"), ns); return ns[name]
patches = {"rope": (lean_llama, "rope_tables", old_fn("drafters/lean_llama.py", lean_llama, "rope_tables")),
           "feed": (text_lm.TextLMDrafter, "_feed_level", old_fn("drafters/text_lm.py", text_lm, "_feed_level", "TextLMDrafter"))}
new = {k: getattr(o, n) for k, (o, n, _) in patches.items()}
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": sys.argv[1]}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
st = {"t": 0.0, "n": 0}
orig = d.propose
def prop(*a, **k):
    t0 = time.perf_counter()
    try: return orig(*a, **k)
    finally: st["t"] += time.perf_counter() - t0; st["n"] += 1
d.propose = prop
n = [0]
def go():
    st["t"] = 0; st["n"] = 0
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
    return 1e3 * st["t"] / st["n"]
def setv(which):
    for k, (o, name, old) in patches.items():
        f = new[k] if which == "new" or which == k else old
        setattr(o, name, f)
go()
res = {}
for r in range(4):
    for v in ("old", "rope", "feed", "new"):
        setv(v); res.setdefault(v, []).append(round(go(), 3))
print({k: (v, round(sorted(v)[len(v)//2], 3)) for k, v in res.items()})
