"""The goodput policy in simulation: a slow step (at step `at`, verify x ov, draft x od) and the length it settles on.
Each row: (long blocks among the last 40 choices, first step after which 10 in a row are gamma); options as GoodputPolicy's
(cold=0, explore_every=0 is the policy before this change)."""
from specula.runtime.engine.adaptive import GoodputPolicy
def tv(tokens): return 0.0085 + 0.0002 * tokens
def td(k): return 0.001 + 0.0002 * k
def run(at, ov, od, steps=400, **kw):
    p = GoodputPolicy(gamma=8, **kw)
    hist = []
    for s in range(steps):
        k = p.choose(["r"])
        v, d = tv(k + 1), td(k) if k else 0.0
        if s == at: v *= ov; d *= od
        p.record_step(["r"], k, d, v, [k], [min(k, 7)])
        hist.append(k)
    first8 = next((i for i in range(at + 1, steps) if all(h == 8 for h in hist[i:i + 10] if True) ), None)
    return hist[-40:].count(8), first8
for kw in ({}, {"cold": 0}, {"explore_every": 0}, {"cold": 0, "explore_every": 0}):
    print(kw, [run(at, ov, od, **kw) for at, ov, od in [(0, 1, 20), (0, 3, 20), (10, 1, 20), (10, 5, 30), (60, 1, 40)]])
