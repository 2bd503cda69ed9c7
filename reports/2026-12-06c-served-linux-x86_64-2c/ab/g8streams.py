import sys, torch
from specula.runtime.bench import served
torch.set_num_threads(2)
suites = sys.argv[1].split(","); n = int(sys.argv[2]); gammas = [int(g) for g in sys.argv[3].split(",")]
streams = int(sys.argv[4]) if len(sys.argv) > 4 else 8
target, processor = served._load("target")
prompts = served.world_prompts(processor, suites, n, seed=1)
runners = {}
for g in gammas:
    r = served.in_process_runners(target, processor, {"kind": "flash"}, g, 64, adaptive=True, begin_after=2)
    runners.setdefault("plain", r["plain"]); runners[f"g{g}"] = r["default"]
sets = served.round_robin(runners, prompts, streams)
base = {}
for name, s in sets.items():
    rows = s["rows"]
    per = {}
    for i in range(0, len(rows), streams):
        b = rows[i:i + streams]
        per.setdefault(b[0]["suite"], []).append((b[0]["wall_s"], sum(x["tokens"] for x in b)))
    rates = {k: sum(t for _, t in v) / sum(w for w, _ in v) for k, v in per.items()}
    if name == "plain": base = rates; btot = sum(x["tokens"] for x in rows) / s["wall_s"]
    tot = sum(x["tokens"] for x in rows) / s["wall_s"]
    print(name, f"{tot:.1f} tok/s {tot/btot:.3f}x", " ".join(f"{k}:{rates[k]/base[k]:.2f}" for k in rates),
          "| batches", " ".join(f"{t/w/ (base_b[i] if name!='plain' else t/w):.2f}" for i, (w, t) in enumerate([x for v in per.values() for x in v])) if name != "plain" else "", flush=True)
    if name == "plain": base_b = [t / w for v in per.values() for (w, t) in v]
