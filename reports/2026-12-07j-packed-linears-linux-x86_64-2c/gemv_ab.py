import sys, time, statistics, torch
torch.set_num_threads(2)
import torch.nn.functional as F
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
from specula.runtime.bench.target_timing import bench_target
from specula.runtime.bench.target import world_prompts
import specula.targets.packed_linear as pl
orig = pl.PackedLinear.forward
def make(th):
    def fwd(self, x):
        if x.numel() == x.shape[-1] and self.weight.numel() * 4 < th:
            return F.linear(x, self.weight, self.bias)
        return orig(self, x)
    return fwd
path = resolve("target")
t = load_target(str(path), device="cpu")
proc = load_processor(path)
fn = lambda: world_prompts(t, proc)
for rnd in range(2):
    for th in (0, 1 << 20, 4 << 20):
        pl.PackedLinear.forward = make(th)
        r = bench_target(t, prompts_fn=fn, repeats=30)
        print(th, "decode", round(r["decode_ms"],3), "verify", [round(v["ratio"],2) for v in r["verify"]])
