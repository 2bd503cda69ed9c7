# usage: ab_prefill.py REV [rounds]: target.prefill with HF_target._prefill_rows from REV (old) vs the working tree
# (new), alternating rounds in one process; checks the two give equal logits and equal hidden states on real slots.
import sys, time, uuid, ast, subprocess, statistics as stt, torch
torch.set_num_threads(2)
from specula.runtime.bench.served import world_prompts, _load
import specula.targets.hf_target as H
rev, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
SUITES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["caption", "vqa", "text"]
src = subprocess.check_output(["git", "-C", "/work/main", "show", f"{rev}:targets/hf_target.py"]).decode()
cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "HFTarget")
fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_prefill_rows")
ns = dict(vars(H)); exec(compile(ast.Module([fn], []), "old", "exec"), ns)
old, new = ns["_prefill_rows"], H.HFTarget._prefill_rows
target, proc = _load("target")
prompts = world_prompts(proc, SUITES, 2)
def once(fn, p):
    H.HFTarget._prefill_rows = fn
    rid = uuid.uuid4().hex
    t0 = time.perf_counter(); out = target.prefill([p.encoded.prefill(rid)]); dt = time.perf_counter() - t0
    target.release([rid])
    return dt, out
for p in prompts:  # equal outputs
    _, a = once(old, p); _, b = once(new, p)
    n = b.features.lengths[0]
    assert torch.equal(a.logits, b.logits), "logits differ"
    assert torch.equal(a.features.hidden[:, :n], b.features.hidden[:, :n]), "hidden differ"
print("outputs equal on", len(prompts), "prompts; lengths", [len(p.encoded.input_ids) for p in prompts])
res = {"old": [], "new": []}
for r in range(rounds):
    for name, fn in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
        ts = [once(fn, p)[0] for p in prompts for _ in range(2)]
        res[name].append(stt.median(ts) * 1e3)
for k, v in res.items():
    print(k, "median ms per prefill per round:", [round(x, 2) for x in v], "median", round(stt.median(v), 2))
