import sys, atexit
from collections import Counter, defaultdict
from specula.runtime.engine import adaptive
hist = defaultdict(Counter)
orig = adaptive.GoodputPolicy.choose
def choose(self, *a, **k):
    v = orig(self, *a, **k); hist[id(self)][v] += 1
    if sum(hist[id(self)].values()) % 40 == 0:
        print("POLICY", id(self), dict(sorted(hist[id(self)].items())), "verify", [round(x*1000,3) for x in (self.verify.weights() or ())],
              "draft", [round(x*1000,3) for x in (self.draft.weights() or ())], "pop", round(self.start(),3), flush=True)
    return v
adaptive.GoodputPolicy.choose = choose
from specula.cli import main
sys.exit(main(["bench", "served", "--suite", "caption", "--n", "6", "--concurrency", "1", "--threads", "2", "--out", sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench-probe"]))
