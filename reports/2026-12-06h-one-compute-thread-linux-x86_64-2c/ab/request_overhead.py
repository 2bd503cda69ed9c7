"""What a request costs outside the engine: the same tiny text chat (max_tokens 1 and 8, greedy, plain decoding)
25 times through `specula serve` (Ray Serve's HTTP proxy, the openai client) and through LocalApp (the same
handlers in this process, no Ray). Prints the median wall time and the engine's own time split of the last request.
Usage: python ab/request_overhead.py     (quiet machine; about a minute)
"""

import time
from pathlib import Path
from tempfile import mkdtemp

from openai import OpenAI

from specula.runtime.bench.served import ServedApp
from specula.runtime.config import load_config
from specula.runtime.serve.local import LocalApp
from specula.runtime.serve.placement import size_reservations

RAW = {"grpc": {"enabled": False}, "drafter": {"gamma": 0}}
MESSAGES = [{"role": "user", "content": "Say hi."}]


def report(tag, ask):
    for mt in (1, 8):
        ts = []
        for _ in range(25):
            t0 = time.perf_counter()
            metrics = ask(mt)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        engine = sum(metrics["time_s"].values())
        print(f"{tag} max_tokens {mt}: median {1e3 * ts[12]:.1f} ms (min {1e3 * ts[0]:.1f}), "
              f"engine {1e3 * engine:.1f} ms of it", flush=True)


with LocalApp.from_config(size_reservations(load_config(RAW))) as app:
    report("LocalApp", lambda mt: app.openai("chat", {"messages": MESSAGES, "max_tokens": mt,
                                                      "temperature": 0.0})["specula"]["metrics"])

with ServedApp(RAW, num_cpus=None, log=Path(mkdtemp()) / "serve.log") as served:
    client = OpenAI(base_url=served.url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(mt):
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=mt, temperature=0.0)
        return r.model_extra["specula"]["metrics"]

    report("served", ask)
