import sys, time, statistics, torch
torch.set_num_threads(2)
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
from specula.runtime.bench.target_timing import bench_target
from specula.runtime.bench.target import world_prompts
from specula.targets.packed_linear import pack_linears, unpack_linears
path = resolve("target")
t = load_target(str(path), device="cpu")
proc = load_processor(path)
fn = lambda: world_prompts(t, proc)
for rnd in range(2):
    for mode in ("mkl", "dnn"):
        if mode == "dnn": print("packed", pack_linears(t.model))
        else: unpack_linears(t.model)
        r = bench_target(t, prompts_fn=fn, repeats=20)
        print(mode, "encode", round(r["encode_ms"],2), "prefill", round(r["prefill_ms"],2), "decode", round(r["decode_ms"],3),
              "verify", [round(v["ratio"],2) for v in r["verify"]])
