import json, time, statistics, http.client, sys
from pathlib import Path
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
prompts = S.world_prompts(processor, ["caption"], 4)
app = S.ServedApp({"grpc": {"enabled": False}, **({"drafter": {"gamma": 0}} if sys.argv[1] == "0" else {})}, num_cpus=None, log=Path("/tmp/exp/hop2.log"))
try:
    r = S.ServedRunner(app.url, 1, 1)
    host, port = "127.0.0.1", app.port
    for mt in (1, 64):
        r.max_tokens = mt
        A, B = [], []
        for rep in range(5):
            for p in prompts:
                row = r.one(p); A.append((row["wall_s"], sum(row["metrics"]["time_s"].values()), row["tokens"]))
                body = json.dumps({"model": r.model, "messages": p.messages, "max_tokens": mt, "temperature": 0.0}).encode()
                c = http.client.HTTPConnection(host, port)
                t0 = time.perf_counter(); c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer none"})
                resp = c.getresponse(); data = json.loads(resp.read()); w = time.perf_counter() - t0; c.close()
                m = data["specula"]["metrics"]
                B.append((w, sum(m["time_s"].values()), data["usage"]["completion_tokens"]))
        for name, X in (("openai", A), ("raw", B)):
            print(mt, name, "wall ms %.1f booked ms %.1f outside ms %.1f (median %.1f)" % (
                1000*statistics.mean(x[0] for x in X), 1000*statistics.mean(x[1] for x in X),
                1000*statistics.mean(x[0]-x[1] for x in X), 1000*statistics.median(x[0]-x[1] for x in X)))
finally:
    app.close()
