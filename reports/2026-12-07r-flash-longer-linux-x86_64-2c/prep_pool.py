# Does preparing requests on another thread (as the served ingress does, asyncio.to_thread) slow the prefill that
# the compute thread runs next? Alternating rounds in one process, no Ray:
#   main:   prepare and prefill on the main thread
#   served: prepare on a worker thread (a ThreadPoolExecutor, as asyncio.to_thread), prefill on a compute thread
#   served1: the same with the worker thread at torch.set_num_threads(1)
import sys, time, uuid, statistics as stt, threading, concurrent.futures as cf, queue, base64, io, torch
torch.set_num_threads(2)
from PIL import Image
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.prompts import encode_messages
def pil(url):
    return Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))).convert("RGB")
def prepare(p):
    imgs, msgs = [], []
    for m in p.messages:
        parts = []
        for x in m["content"]:
            if x["type"] == "image_url":
                imgs.append(pil(x["image_url"]["url"])); parts.append({"type": "image"})
            else:
                parts.append(x)
        msgs.append({"role": m["role"], "content": parts})
    return encode_messages(proc, msgs, imgs)
def prefill(enc):
    rid = uuid.uuid4().hex
    t0 = time.perf_counter(); target.prefill([enc.prefill(rid)]); dt = time.perf_counter() - t0
    target.release([rid]); return dt
class Compute:
    def __init__(self):
        self.q = queue.Queue(); threading.Thread(target=self.run, daemon=True).start()
    def run(self):
        torch.set_num_threads(2)
        while True:
            f, a, fut = self.q.get(); fut.set_result(f(*a))
    def call(self, f, *a):
        fut = cf.Future(); self.q.put((f, a, fut)); return fut.result()
comp = Compute()
target, proc = comp.call(_load, "target")  # the served replica loads its models on its compute thread
ps = comp.call(world_prompts, proc, ["caption", "vqa"], 3)
pool2 = cf.ThreadPoolExecutor(1)
pool1 = cf.ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(1))
for p in ps: comp.call(prefill, comp.call(prepare, p))
def served_round(pool): return [comp.call(prefill, pool.submit(prepare, p).result()) for p in ps]
mode = sys.argv[1]
run = {"compute": lambda: [comp.call(prefill, enc) for enc in encs],  # prepared once, up front, on the compute thread
       "worker2": lambda: served_round(pool2), "worker1": lambda: served_round(pool1)}[mode]
encs = [comp.call(prepare, p) for p in ps]
v = [stt.median(run()) * 1e3 for _ in range(4)]
print(f"{mode}: median prefill ms per round {[round(x, 1) for x in v]}, median {stt.median(v):.2f}")
