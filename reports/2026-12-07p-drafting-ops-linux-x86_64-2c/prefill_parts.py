import time, torch, uuid, statistics as st
torch.set_num_threads(2)
from specula.runtime.bench.served import world_prompts, _load
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "vqa", "chart"], 3)
def t_prefill():
    ts = []
    for p in prompts:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter(); target.prefill([p.encoded.prefill(rid)]); ts.append(time.perf_counter() - t0)
        target.release([rid])
    return st.median(ts) * 1e3
def t_vision():
    ts = []
    for p in prompts:
        pv = p.encoded.pixel_values
        t0 = time.perf_counter(); target.encode_images(pv, "projected"); ts.append(time.perf_counter() - t0)
    return st.median(ts) * 1e3
for _ in range(2): t_prefill(); t_vision()
print("prefill (incl vision)", [round(t_prefill(), 2) for _ in range(5)])
print("vision", [round(t_vision(), 2) for _ in range(5)])
print("pixel shape", prompts[0].encoded.pixel_values.shape, len(prompts[0].encoded.input_ids))
