"""``specula bench served``: the served runtime against plain decoding, on real Ray Serve, in one run.

Two applications are started with ``specula serve`` (real processes, each on its own local Ray, the given config):
the **default** configuration (its drafter and gamma) and the same with ``drafter.gamma: 0`` (**plain**: no
DrafterEnsemble, the verifier decodes alone). Beside them, this process decodes **in process** (``SpecEngine``,
plain and with the default drafter, ``--threads`` torch threads). The four runners take the same prompts (world
evaluation suites; served ones get them over HTTP from the ``openai`` client, images as data: URLs) batch by batch,
round robin with the order rotating, so drift of the machine hits them alike: first one stream at a time, then
``--concurrency`` streams at once (a batch of that many prompts decoded together in process, as many concurrent
HTTP requests served)::

    specula bench served                              # the shipped target, every suite, 1 and 8 streams
    specula bench served --suite caption --n 6 --concurrency 1
    specula bench served --config specula.yaml --num-cpus 2 --out reports/bench-served

Reported per (runtime, configuration, streams): tokens/s (completion tokens / wall time of the whole set), the
speedup over plain decoding of the same runtime and over in-process plain, tau, and the per-phase time split the
verifier reports (vision, prefill, draft, draft_begin, caption, verify, sample, commit; ms per generated token).
Greedy outputs are compared with in-process plain decoding token for token (``exact``). The same split gives the
ceilings the measured speedups are read against (``ceilings.py``: the prefill stays whatever is drafted). Writes
``served.json`` and ``served.md``.

Where the served time goes, at one stream: the in-process runners run once more **beside the idle plain app**
(runtime ``beside_ray``: its Ray left running, taking no requests), so Ray's own background (its daemons' and the
replica's periodic wake-ups; on a small machine they take cores from the forward's threads) is measured apart
from the request path; and each request's time outside the engine (its wall time less the phases the verifier
booked: HTTP, JSON, the image decode and processor, the hand-offs between threads, the client) is reported per
row (``outside_engine_ms``). ``--no-beside-ray`` leaves the extra runs out.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specula.runtime.bench.ceilings import ceilings, ceilings_md
from specula.runtime.bench.constants import BENCH_OFFSET, EVAL_SUITES
from specula.runtime.engine.metrics import TIME_KEYS

SUITES = EVAL_SUITES
READY = "specula: serving"
BESIDE = "beside_ray"  # the in-process runners, measured with the plain app's Ray running idle beside them


@dataclass(frozen=True)
class Prompt:
    suite: str
    prompt_id: str
    messages: list  # OpenAI chat messages, images as data: URLs
    encoded: object  # EncodedPrompt for the in-process runs


def world_prompts(processor, suites, n: int, seed: int = 0) -> list[Prompt]:
    """``n`` evaluation prompts per suite, as OpenAI messages and as the target's own encoding of the same turn."""
    from specula.runtime.engine.prompts import encode_prompt, prompt_messages
    from specula.world import generate

    out = []
    for suite in suites:
        for i in range(n):
            s = generate(suite, "eval", BENCH_OFFSET + i, seed)
            images = iter([_data_url(im) for im in s.images])
            messages = []
            for m in prompt_messages(s.prompt, len(s.images), s.system):
                parts = [{"type": "image_url", "image_url": {"url": next(images)}} if p["type"] == "image" else p
                         for p in m["content"]]
                messages.append({"role": m["role"], "content": parts})
            out.append(Prompt(suite, f"{suite}-{i}", messages, encode_prompt(processor, s.prompt, s.images, s.system)))
    return out


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------------------------- one served app


class ServedApp:
    """``specula serve --config <cfg>`` in a child process on a free port, until ``close`` (SIGTERM, then kill).

    ``ready_timeout`` bounds the start; the child's output goes to ``log`` (a file), and its tail is in the error
    when it does not come up."""

    def __init__(self, config: dict, *, num_cpus: int | None, log: Path, ready_timeout: float = 300.0):
        from specula.runtime.serve.direct_http import free_port

        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sb", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
        cfg_file = self.dir / "config.yaml"
        cfg_file.write_text(json.dumps(config))  # JSON is YAML
        cmd = [sys.executable, "-m", "specula.cli", "serve", "--config", str(cfg_file), "--port", str(self.port), "--ray-temp-dir", str(self.dir / "ray")]
        if num_cpus is not None:
            cmd += ["--num-cpus", str(num_cpus)]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_TMPDIR": str(self.dir), "PYTHONUNBUFFERED": "1"}
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"specula serve did not become ready (see {log}): {_tail(log)}")
            try:
                if READY in lines.get(timeout=min(left, 1.0)):
                    break
            except queue.Empty:
                continue
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _pump(self, lines) -> None:
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            lines.put(line)

    def processes(self) -> list[int]:
        """This app's processes: ``specula serve`` and every descendant (its Ray: GCS, raylet, workers, replicas)."""
        children: dict[int, list[int]] = defaultdict(list)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def freeze(self, frozen: bool) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) every process of this app: an idle Ray still wakes up many times a
        second, and on a small machine that would be charged to whatever else is measured meanwhile."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.freeze(False)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._out.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ServedApp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return ""


class ServedRunner:
    """Batches of prompts through one served app's OpenAI chat route, a stream per prompt of the batch (greedy)."""

    def __init__(self, url: str, max_tokens: int, streams: int):
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600.0)
        self.model = self.client.models.list().data[0].id  # the served name (http.served_model_name, else the model's)
        self.max_tokens = max_tokens
        self.pool = concurrent.futures.ThreadPoolExecutor(streams)

    def one(self, p: Prompt) -> dict:
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.model, messages=p.messages, max_tokens=self.max_tokens,
                                                temperature=0.0)
        ext = (r.model_extra or {}).get("specula") or {}
        return {"prompt_id": p.prompt_id, "suite": p.suite, "wall_s": time.perf_counter() - t0,
                "text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
                "metrics": ext.get("metrics") or {}}

    def __call__(self, batch: list[Prompt]) -> list[dict]:
        return list(self.pool.map(self.one, batch))

    def close(self) -> None:
        self.pool.shutdown()


class InProcessRunner:
    """Batches of prompts decoded together by a ``SpecEngine`` in this process (greedy)."""

    def __init__(self, engine, tokenizer, max_tokens: int, text_only: str | None = None):
        from specula.runtime.core.sampling import SamplingParams

        self.engine, self.tokenizer, self.text_only = engine, tokenizer, text_only
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.calls = 0

    def __call__(self, batch: list[Prompt]) -> list[dict]:
        from specula.runtime.engine.drafter_route import route

        self.calls += 1
        t0 = time.perf_counter()
        res = self.engine.generate([route(p.encoded.request(f"{p.prompt_id}#{self.calls}", self.params),
                                          self.text_only) for p in batch])
        wall = time.perf_counter() - t0
        rows = []
        for p in batch:
            r = res[f"{p.prompt_id}#{self.calls}"]
            rows.append({"prompt_id": p.prompt_id, "suite": p.suite, "wall_s": wall, "tokens": len(r.tokens),
                         "text": self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                         "metrics": r.metrics.to_dict()})
        return rows

    def close(self) -> None:
        pass


def in_process_runners(target, processor, drafter: dict, gamma: int, max_tokens: int, adaptive: bool = False,
                       begin_after: int = 0, alternatives: dict[str, dict] | None = None,
                       text_only: str | None = None, default_name: str | None = None) -> dict:
    """``plain`` (no drafter) and, with gamma > 0, ``default`` (the config's drafter, its draft length chosen per
    step with ``adaptive`` and begun after ``begin_after`` tokens, as a colocated drafter's) in this process; with
    ``alternatives`` (name -> ``{"kind", <options>}``) a MultiDrafter over them all, the default under
    ``default_name`` (else its kind), and requests without images that name none drafting with ``text_only``, as
    the served verifier routes them (runtime/engine/drafter_route.py)."""
    from specula.runtime.bench.spec import make_drafter
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.engine.prompts import eos_ids

    eos = eos_ids(processor.tokenizer, target)
    out = {"plain": InProcessRunner(SpecEngine(target, None, gamma=0, eos_token_ids=eos), processor.tokenizer,
                                    max_tokens)}
    if gamma > 0:
        built = make_drafter(drafter, target, processor.tokenizer)
        if alternatives:
            from specula.drafters.multi_drafter import MultiDrafter

            name = default_name or drafter["kind"]
            built = MultiDrafter({name: built, **{n: make_drafter(c, target, processor.tokenizer)
                                                  for n, c in alternatives.items()}}, default=name)
        engine = SpecEngine(target, built, gamma=gamma, eos_token_ids=eos, adaptive=adaptive, begin_after=begin_after)
        out["default"] = InProcessRunner(engine, processor.tokenizer, max_tokens, text_only if alternatives else None)
    return out


def round_robin(runners: dict, prompts: list[Prompt], streams: int, apps: dict | None = None) -> dict[str, dict]:
    """Every runner on every batch of ``streams`` prompts, the runners' order rotating from batch to batch, so
    drift of the machine hits them alike; per runner the summed wall time of its batches and its rows. ``apps``
    (runner name -> the ``ServedApp`` left running while it runs; several names may share one): every other app is
    frozen, so each runtime is measured as it would run alone on the machine (the in-process runners with no Ray
    beside them, unless ``apps`` names one for them)."""
    from tqdm import tqdm

    apps = apps or {}
    every = list({id(a): a for a in apps.values()}.values())

    def alone(name: str, batch: list[Prompt]) -> tuple[float, list[dict]]:
        for app in every:
            app.freeze(app is not apps.get(name))
        try:
            t0 = time.perf_counter()
            rows = runners[name](batch)
            return time.perf_counter() - t0, rows
        finally:
            for app in every:
                app.freeze(False)

    for name in runners:  # warm-up: lazy initialisation in every replica and engine
        alone(name, prompts[:1])
    names = list(runners)
    sets = {n: {"wall_s": 0.0, "rows": []} for n in names}
    batches = [prompts[a:a + streams] for a in range(0, len(prompts), streams)]
    for i, batch in enumerate(tqdm(batches, desc=f"{streams} stream(s)", unit="batch")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            wall, rows = alone(name, batch)
            sets[name]["wall_s"] += wall
            sets[name]["rows"] += rows
    return sets


def _load(model: str, device: str = "cpu"):
    from specula.runtime.bench.spec import load

    _, processor, target, _ = load(model, device=device, hf=False)
    return target, processor


# ----------------------------------------------------------------------------------------------- the run


def configs(base: dict) -> dict[str, dict]:
    """The default configuration and its plain twin (``drafter.gamma: 0``)."""
    plain = json.loads(json.dumps(base))
    plain.setdefault("drafter", {})["gamma"] = 0
    return {"default": base, "plain": plain}


def summarize(sets: dict, reference: dict) -> dict:
    """One row per (runtime, config, streams): tokens/s, tau, time split per token, exact vs in-process plain."""
    ref_text = {r["prompt_id"]: r["text"] for r in reference["rows"]}
    out = {}
    for key, s in sets.items():
        rows = s["rows"]
        tokens = sum(r["tokens"] for r in rows)
        blocks = sum((r["metrics"] or {}).get("blocks", 0) for r in rows)
        accepted = sum((r["metrics"] or {}).get("accepted_tokens", 0) for r in rows)
        split = defaultdict(float)
        for r in rows:
            for k, v in ((r["metrics"] or {}).get("time_s") or {}).items():
                split[k] += v
        if key.split("/")[2] == "1":  # each request alone: its wall time less what the engine booked for it
            outside = [r["wall_s"] - sum(((r["metrics"] or {}).get("time_s") or {}).values()) for r in rows]
            outside_ms = round(1000 * sum(outside) / max(len(outside), 1), 2)
        else:
            outside_ms = None
        per_suite = defaultdict(lambda: [0, 0.0])
        longest = defaultdict(int)
        for r in rows:
            per_suite[r["suite"]][0] += r["tokens"]
            per_suite[r["suite"]][1] += r.get("wall_s", 0.0)
            longest[r["suite"]] = max(longest[r["suite"]], r["tokens"])
        out[key] = {
            "tokens": tokens, "wall_s": round(s["wall_s"], 3), "tokens_per_s": round(tokens / s["wall_s"], 2),
            "tau": round((accepted + blocks) / blocks, 3) if blocks else None,  # the metrics' convention
            "ms_per_token": {k: round(1000 * split[k] / max(tokens, 1), 3) for k in TIME_KEYS if k in split},
            "exact": all(ref_text.get(r["prompt_id"]) == r["text"] for r in rows),
            "outside_engine_ms": outside_ms,  # per request, one stream only (None with several)
            "per_suite_tokens_per_s": {k: round(v[0] / v[1], 2) for k, v in per_suite.items() if v[1] > 0},
            "per_suite_longest_answer": dict(longest),
        }
    return out


def run(args, log=print) -> dict:
    import torch

    from specula.runtime.config import load_config, read_config

    raw = read_config(args.config) if args.config else {}
    if args.model:
        raw = {**raw, "model": {**(raw.get("model") or {}), "path": args.model}}
    raw = {**raw, "grpc": {**(raw.get("grpc") or {}), "enabled": False}}
    cfg = load_config(raw)
    gamma, model = cfg.drafter.gamma, cfg.model.path
    drafter = {"kind": cfg.drafter.kind, **cfg.drafter.options}
    alternatives = {n: {"kind": a.kind, **a.options} for n, a in cfg.drafter.alternatives.items()}
    torch.set_num_threads(args.threads)
    target, processor = _load(model, getattr(args, "device", "cpu"))
    prompts = world_prompts(processor, args.suite or SUITES, args.n, args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    apps = {}
    try:
        for name, c in configs(raw).items():  # both up before anything is measured (each on its own local Ray)
            if name == "default" and gamma == 0:
                continue
            log(f"[bench served] starting specula serve ({name}: drafter {cfg.drafter.kind}, gamma "
                f"{c.get('drafter', {}).get('gamma', gamma)})")
            apps[name] = ServedApp(c, num_cpus=args.num_cpus, log=out_dir / f"serve-{name}.log")
        sets: dict[str, dict] = {}
        for streams in args.concurrency:
            runners = {f"in_process/{n}/{streams}": r
                       for n, r in in_process_runners(
                           target, processor, drafter, gamma, args.max_tokens, cfg.drafter.adaptive,
                           cfg.drafter.begin_after, alternatives=alternatives, text_only=cfg.drafter.text_only,
                           default_name=cfg.drafter.default_name).items()}
            unfrozen = {f"served/{n}/{streams}": a for n, a in apps.items()}
            if streams == 1 and getattr(args, "beside_ray", True) and "plain" in apps:
                for n in ("plain", "default"):  # the same engines, with the idle plain app's Ray left running
                    if f"in_process/{n}/1" in runners:
                        runners[f"{BESIDE}/{n}/1"] = runners[f"in_process/{n}/1"]
                        unfrozen[f"{BESIDE}/{n}/1"] = apps["plain"]
            runners.update({f"served/{n}/{streams}": ServedRunner(a.url, args.max_tokens, streams)
                            for n, a in apps.items()})
            log(f"[bench served] {streams} stream(s): {', '.join(runners)}, round robin, each alone")
            sets.update(round_robin(runners, prompts, streams, unfrozen))
            for r in set(runners.values()):
                r.close()
    finally:
        for a in apps.values():
            a.close()
    rows = summarize(sets, sets[f"in_process/plain/{args.concurrency[0]}"])
    for key, r in rows.items():
        runtime, name, streams = key.split("/")
        base = rows.get(f"{runtime}/plain/{streams}")
        ip = rows.get(f"in_process/plain/{streams}")
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        r["vs_in_process_plain"] = round(r["tokens_per_s"] / ip["tokens_per_s"], 3) if ip else None
    return {"bench": "served", "model": str(model), "drafter": drafter, "gamma": gamma,
            "text_only": cfg.drafter.text_only if gamma > 0 else None,
            "suites": list(args.suite or SUITES), "n_per_suite": args.n, "max_tokens": args.max_tokens,
            "concurrency": list(args.concurrency), "threads_in_process": args.threads, "num_cpus": args.num_cpus,
            "config": raw, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                       "torch": torch.__version__},
            "rows": rows, "ceilings": [c.to_dict() for c in ceilings(rows)],
            "raw": {k: v["rows"] for k, v in sets.items()}}


def render_markdown(r: dict) -> str:
    lines = [f"# Specula bench: served vs in-process, plain vs {r['drafter']['kind']}@{r['gamma']}"
             + (f" ({r['text_only']} for text-only requests)" if r.get("text_only") else ""), "",
             f"Model `{r['model']}`, {r['machine']['cpus']} CPUs, torch {r['machine']['torch']}; "
             f"{r['n_per_suite']} prompts x {len(r['suites'])} suites, max_tokens {r['max_tokens']}, greedy. Served: "
             "`specula serve` on a local Ray, the openai client over HTTP; in process: SpecEngine at "
             f"{r['threads_in_process']} torch threads.", "",
             "| runtime | config | streams | tokens/s | x plain (same runtime) | x in-process plain | tau | "
             "exact |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key, row in r["rows"].items():
        runtime, name, streams = key.split("/")
        lines.append(f"| {runtime} | {name} | {streams} | {row['tokens_per_s']} | {row['speedup_vs_plain']} | "
                     f"{row['vs_in_process_plain']} | {row['tau']} | {row['exact']} |")
    lines += ["", "## Time split (ms per generated token, as the verifier books it)", "",
              "| runtime | config | streams | " + " | ".join(TIME_KEYS) + " |",
              "| --- | --- | ---: |" + " ---: |" * len(TIME_KEYS)]
    for key, row in r["rows"].items():
        runtime, name, streams = key.split("/")
        cells = " | ".join(str(row["ms_per_token"].get(k, "")) for k in TIME_KEYS)
        lines.append(f"| {runtime} | {name} | {streams} | {cells} |")
    suites = r["suites"]
    first = r["concurrency"][0]
    # per request's own wall time; an in-process batch of several prompts has one wall for all: one stream only
    rows = {k: row for k, row in r["rows"].items() if int(k.split("/")[2]) == first and not k.startswith(BESIDE)
            and (first == 1 or not k.startswith("in_process/"))}
    lines += ["", f"## tokens/s per suite ({first} stream(s): each request's own wall time)", "",
              "| runtime | config | " + " | ".join(suites) + " |", "| --- | --- |" + " ---: |" * len(suites)]
    for key, row in rows.items():
        runtime, name, _ = key.split("/")
        lines.append(f"| {runtime} | {name} | " + " | ".join(str(row["per_suite_tokens_per_s"].get(s, ""))
                                                             for s in suites) + " |")
    lines += ["", "## Speedup per suite (x plain of the same runtime, same streams)", "",
              "| runtime | config | streams | " + " | ".join(suites) + " |",
              "| --- | --- | ---: |" + " ---: |" * len(suites)]
    for runtime, name, streams, ratios in suite_speedups(r["rows"], suites):
        lines.append(f"| {runtime} | {name} | {streams} | "
                     + " | ".join("" if x is None else f"{x:.2f}x" for x in ratios) + " |")
    if split := served_split_md(r["rows"]):
        lines += ["", "## Where the served time goes", "", *split]
    if per_suite := served_per_suite_md(r["rows"], suites):
        lines += ["", *per_suite]
    if any(int(s) > 1 for s in r["concurrency"]):
        lines += ["", MANY_STREAMS_NOTE]
    if ceiling_lines := ceilings_md(r["rows"], longest_answers(r["rows"])):
        lines += ["", "## Ceilings", "", *ceiling_lines]
    return "\n".join(lines) + "\n"


def served_split(rows: dict) -> list[dict]:
    """Per config at one stream, where the served runtime's time goes against in-process decoding: ``background``
    (in process beside the idle plain app's Ray over in process alone: Ray's own background), ``path`` (served over
    in process beside that Ray: the request path of Serve, HTTP and the client apart from Ray's background) and each
    request's time outside the engine (ms). Empty without the ``beside_ray`` rows."""
    out = []
    for name in ("plain", "default"):
        alone, beside, served = (rows.get(f"{rt}/{name}/1") for rt in ("in_process", BESIDE, "served"))
        if not (alone and beside and served):
            continue
        out.append({"config": name, "in_process": alone["tokens_per_s"], "beside_ray": beside["tokens_per_s"],
                    "served": served["tokens_per_s"],
                    "background": round(beside["tokens_per_s"] / alone["tokens_per_s"], 3),
                    "path": round(served["tokens_per_s"] / beside["tokens_per_s"], 3),
                    "served_vs_in_process": round(served["tokens_per_s"] / alone["tokens_per_s"], 3),
                    "outside_ms_in_process": alone.get("outside_engine_ms"),
                    "outside_ms_served": served.get("outside_engine_ms")})
    return out


def served_split_md(rows: dict) -> list[str]:
    """``served_split`` as a markdown table with a line that reads it (empty without the rows)."""
    split = served_split(rows)
    if not split:
        return []
    lines = ["Where the served time goes (one stream): in-process decoding once more with the idle plain app's Ray "
             "left running beside it (`beside_ray`) parts Ray's own background from the request path; outside the "
             "engine: a request's wall time less the phases the engine booked for it.", "",
             "| config | tokens/s in process | beside idle Ray | served | Ray's background (beside / alone) | "
             "the served path (served / beside) | served / in process | outside the engine, ms per request: "
             "in process / served |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in split:
        lines.append(f"| {x['config']} | {x['in_process']} | {x['beside_ray']} | {x['served']} | "
                     f"{x['background']:.3f} | {x['path']:.3f} | {x['served_vs_in_process']:.3f} | "
                     f"{x['outside_ms_in_process']} / {x['outside_ms_served']} |")
    return lines


def served_per_suite(rows: dict, suites) -> list[tuple[str, list[float | None]]]:
    """Per config at one stream, each suite's served tokens/s over in-process tokens/s of the same config (each
    request's own wall time): (config, [ratio or None per suite]). The plain row's captions say how close the served
    path comes to one process; short answers show the fixed cost of a served request."""
    out = []
    for name in ("plain", "default"):
        alone, served = rows.get(f"in_process/{name}/1"), rows.get(f"served/{name}/1")
        if not (alone and served):
            continue
        srv, own = served.get("per_suite_tokens_per_s") or {}, alone.get("per_suite_tokens_per_s") or {}
        out.append((name, [srv[s] / own[s] if srv.get(s) and own.get(s) else None for s in suites]))
    return out


def served_per_suite_md(rows: dict, suites) -> list[str]:
    """``served_per_suite`` as a markdown table with the line that reads it (empty without the rows)."""
    table = served_per_suite(rows, suites)
    if not table:
        return []
    return ["Served over in process, per suite (one stream, the same config, tokens/s of each request's own wall "
            "time; a request's fixed served cost, about 10 ms, weighs most on the one- and two-token answers):", "",
            "| config | " + " | ".join(suites) + " |", "| --- |" + " ---: |" * len(suites),
            *(f"| {name} | " + " | ".join("" if x is None else f"{x:.3f}" for x in ratios) + " |"
              for name, ratios in table)]


MANY_STREAMS_NOTE = ("With several streams, a request's own wall time includes the batched prefill it arrives into "
                     "(the prompts that came with it), which varies with arrival order from run to run; for short "
                     "answers that prefill is most of it. The whole set's tokens/s is the figure to read there.")


def longest_answers(rows: dict) -> dict[str, int]:
    """suite -> the longest answer over every row (greedy: each configuration gives the same answers)."""
    out: dict[str, int] = {}
    for row in rows.values():
        for s, n in (row.get("per_suite_longest_answer") or {}).items():
            out[s] = max(out.get(s, 0), n)
    return out


def suite_speedups(rows: dict, suites) -> list[tuple[str, str, str, list[float | None]]]:
    """Per suite, each configuration's tokens/s over plain decoding's in the same runtime at the same streams:
    (runtime, config, streams, [ratio or None per suite]) for the rows whose requests have wall times of their own
    (served rows; in-process rows of one stream: an in-process batch of several has one wall time for all)."""
    out = []
    for key, row in rows.items():
        runtime, name, streams = key.split("/")
        plain = rows.get(f"{runtime}/plain/{streams}")
        if name == "plain" or plain is None or runtime == BESIDE or (runtime == "in_process" and streams != "1"):
            continue
        a, b = row.get("per_suite_tokens_per_s") or {}, plain.get("per_suite_tokens_per_s") or {}
        out.append((runtime, name, streams, [a[s] / b[s] if a.get(s) and b.get(s) else None for s in suites]))
    return out


def write_report(r: dict, out: str | Path) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "served.json").write_text(json.dumps(r, indent=1))
    (d / "served.md").write_text(render_markdown(r))
    return d


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config of the served application (default: the defaults)")
    p.add_argument("--model", default=None, help="model.path over the config's (default: the config's)")
    p.add_argument("--suite", action="append", default=[], help=f"suite, repeatable (default: all of {SUITES})")
    p.add_argument("--n", type=int, default=4, help="prompts per suite (default: 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most (default: 64)")
    p.add_argument("--concurrency", type=int, action="append", default=[],
                   help="streams at once, repeatable (default: 1 and 8)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the in-process runs (default: the machine's CPUs, or --num-cpus)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: the in-process runs' target and drafter (the served ones follow the "
                        "config's deployments.*.device; default: cpu)")
    p.add_argument("--no-beside-ray", dest="beside_ray", action="store_false",
                   help="leave out the in-process runs beside the idle plain app's Ray (one stream), which part "
                        "Ray's own background from the served request path (default: measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="reports/bench-served", help="output directory (default: reports/bench-served)")


def main(args) -> int:
    if not args.concurrency:
        args.concurrency = [1, 8]
    if any(c < 1 for c in args.concurrency) or args.n < 1 or args.max_tokens < 1:
        print("bench served: --concurrency, --n and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.threads is None:
        args.threads = args.num_cpus or os.cpu_count() or 1
    r = run(args)
    d = write_report(r, args.out)
    print(render_markdown(r))
    print(f"[bench served] wrote {d / 'served.json'} and {d / 'served.md'}")
    return 0
