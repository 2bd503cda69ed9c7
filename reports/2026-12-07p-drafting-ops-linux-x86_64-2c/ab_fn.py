# usage: ab_fn.py DRAFTER REV module.path:func[:Class] ... ; alternates HEAD~ (REV) functions against the working tree's
import sys, time, torch, ast, subprocess, importlib, statistics as stt
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
kind, rev, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
def old_fn(path, mod, name, cls=None):
    src = subprocess.check_output(["git", "-C", "/work/main", "show", f"{rev}:{path}"]).decode()
    body = ast.parse(src).body
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = dict(vars(mod)); exec(compile(ast.Module([fn], []), "old", "exec"), ns); return ns[name]
patches = []
for sp_ in specs:
    path, name, *cls = sp_.split(":")
    modname = "specula." + path[:-3].replace("/", ".")
    mod = importlib.import_module(modname)
    owner = getattr(mod, cls[0]) if cls else mod
    patches.append((owner, name, getattr(owner, name), old_fn(path, mod, name, cls[0] if cls else None)))
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": kind}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
st = {"t": 0.0, "n": 0}
orig = lambda *a, **k: type(d).propose(d, *a, **k)
def prop(*a, **k):
    t0 = time.perf_counter()
    try: return orig(*a, **k)
    finally: st["t"] += time.perf_counter() - t0; st["n"] += 1
d.propose = prop
n = [0]
def go():
    st["t"] = 0; st["n"] = 0; acc = 0; blocks = 0
    for p in prompts:
        n[0] += 1; r = eng.generate([p.encoded.request(f"r{n[0]}", sp)])
        m = next(iter(r.values())).metrics; acc += m.accepted_tokens; blocks += m.blocks
    return round(1e3 * st["t"] / st["n"], 3), round((acc + blocks) / blocks, 3)
def setv(which):
    for owner, name, new, old in patches:
        setattr(owner, name, new if which == "new" else old)
setv("old"); go(); setv("new"); go()
res = {"old": [], "new": []}
for r in range(int(__import__("os").environ.get("ROUNDS", "4"))):
    for v in ("old", "new"):
        setv(v); res[v].append(go())
for k, v in res.items():
    print(kind, k, v, "median ms", stt.median(x[0] for x in v))
