"""``specula bench distributed``: the distributed runtime's overlap, measured side by side in one run.

The drafter runs in its own process (a ``DrafterServer`` on 127.0.0.1, one torch thread), the verifier in this one
(one torch thread). For every prompt the configurations run one after another, round robin, so machine drift hits
them alike:
  plain           this process, no drafter: the reference output and the time every speedup divides
  single_process  ``SpecEngine`` with the same drafter in this process (no wire, no overlap)
  sequential      ``VerifierEngine`` + the remote drafter, overlap off (propose, verify, observe, in turn)
  pipelined       the same, overlap on: the drafter drafts block n+1 while block n is verified (PEARL post-verify)
  predraft        pipelined, and while the verdict is out the drafter also drafts blocks for its likeliest
                  rejection outcomes (SSD / Saguaro, ``--predraft`` of them; drafters with ``Predraft``: text_lm,
                  eagle and msd chains)
  offers          predraft, and the drafter sends those blocks unasked as soon as they are drafted (Offers): a
                  verdict that matches one is verified at once, without the ProposeRequest round trip

Reported: tau; speedups (vs plain, pipelined vs sequential), end to end and in the decode phase (from each
request's first token to its last: prefill, vision and the drafter's Begin happen once per request and overlap
cannot touch them, so short answers hide what it does); tokens per request per suite; the time split per block
step (verify, draft on the critical path, transfer, idle, drafting ahead) and the transfer share of a block step;
the drafter's time on the verifier's critical path per block over T_decode (``critical_draft_vs_t_decode``: asking
for and waiting on the proposal and sending the verdict, as the verifier books it; in a single process the drafting
itself; the drafter's Begin of each request apart, as ``draft_begin_s``);
pre-drafted blocks used / dropped; overlap efficiency = speedup / (tau * T_decode / T_verify(gamma)) with
T_decode the plain step and T_verify(gamma) the verify step of that run (1.0 = the ideal of drafting for free);
wire bytes per codec (fp32, fp16, int8, int8+zstd) of the target features a drafter may need, encoded as real
frames, and of the session traffic measured in the pipelined run. Greedy outputs are checked against plain decoding (``greedy_exact``).

    specula bench distributed --quick                 # the shipped target, a few prompts, a few minutes
    specula bench distributed --pin-cores             # verifier and drafter on a core each, as on two devices
    specula bench distributed --model DIR --drafter ngram --n 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

CONFIGS = ("plain", "single_process", "sequential", "pipelined", "predraft", "offers")
REMOTE = {"sequential": dict(overlap=False, offers=False),
          "pipelined": dict(overlap=True, predraft=False, offers=False),
          "predraft": dict(overlap=True, predraft=True, offers=False),
          "offers": dict(overlap=True, predraft=True, offers=True)}  # RemoteDrafter settings per remote config
CODECS = ("fp32", "fp16", "int8", "int8+zstd")
QUICK = {"n": 2, "max_tokens": 24, "suites": ("caption", "vqa", "text")}


def default_drafter() -> dict:
    """text_lm when its weights are shipped, else ngram."""
    from specula.zoo.store import ZOO_DIR

    return {"kind": "text_lm"} if (ZOO_DIR / "text_lm").is_dir() else {"kind": "ngram"}


def _make_drafter(spec: dict, model: str, target=None):
    """A drafter from its config; the target (loaded here if needed) gives image token, vocabulary, embeddings."""
    from specula.drafters import create, registry
    from specula.targets import load_target
    from specula.zoo.store import resolve

    named = registry.accepted_options(spec["kind"])
    opts, resources = {k: v for k, v in spec.items() if k != "kind"}, {}
    if "target" in named:
        resources["target"] = target if target is not None else load_target(resolve(model))
    else:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(resolve(model), local_files_only=True)
        image = getattr(hf, "image_token_id", None)
        image = getattr(hf, "image_token_index", None) if image is None else image
        facts = {"vocab_size": int(hf.get_text_config().vocab_size), "image_token_id": image}
        opts.update({k: v for k, v in facts.items() if k in named and k not in opts and v is not None})
    return create({"kind": spec["kind"], **opts}, **resources)


# ------------------------------------------------------------------------------------------- the drafter process

def serve_drafter(spec: dict, model: str, predraft: int = 3, core: int | None = None) -> None:
    """Child process: serve ``spec`` on 127.0.0.1 (overlap allowed), print the address and the CPU cores it runs on,
    stop when stdin closes. ``core``: pin this process (every thread it starts) to that CPU core first."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from specula.runtime.dataplane import DrafterServer

    server = DrafterServer(_make_drafter(spec, model), host="127.0.0.1", overlap=True, accept_codecs=CODECS,
                           predraft=predraft)
    print(f"ADDRESS {server.start()} {','.join(map(str, sorted(_cores())))}", flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies): stop
    server.stop(0)


class _DrafterProcess:
    def __init__(self, spec: dict, model: str, timeout_s: float = 300.0, predraft: int = 3,
                 core: int | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        pin = [] if core is None else ["--core", str(core)]
        self.proc = subprocess.Popen([sys.executable, "-m", "specula.runtime.bench.distributed", "--serve-drafter",
                                      json.dumps(spec), "--model", str(model), "--predraft", str(predraft), *pin],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + timeout_s
        self.address, self.cores = None, None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("ADDRESS "):
                _, self.address, cores = line.split()
                self.cores = [int(c) for c in cores.split(",")]
                break
        if self.address is None:
            self.close()
            raise RuntimeError(f"the drafter process did not start (exit code {self.proc.poll()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------------------- the run

def run(model: str, drafter: dict, gamma: int, suites, n: int, max_tokens: int, temperature: float = 0.0,
        seed: int = 0, log=print, predraft: int = 3, pin_cores: bool = False) -> dict:
    """Every config round robin on the same prompts, the verifier here on one torch thread as the drafter process
    is (a caller's thread count, e.g. the report's ``--threads 2``, would put three compute threads on two cores
    while both processes work; it is restored at the end). ``pin_cores``: the verifier (this thread and every
    thread it starts here) on one CPU core, the drafter process on another, as on separate devices (needs 2 usable
    cores; the affinity is restored at the end)."""
    import torch

    before, threads = _cores(), torch.get_num_threads()
    pinned = sorted(before)[:2] if pin_cores and len(before) >= 2 else None
    if pinned:
        os.sched_setaffinity(0, {pinned[0]})
    torch.set_num_threads(1)
    try:
        return _run(model, drafter, gamma, suites, n, max_tokens, temperature, seed, log, predraft, pinned)
    finally:
        torch.set_num_threads(threads)
        if pinned:
            os.sched_setaffinity(0, before)


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _run(model, drafter, gamma, suites, n, max_tokens, temperature, seed, log, predraft, pinned) -> dict:
    from specula.runtime.bench.spec import encoded_prompts
    from specula.runtime.engine.prompts import eos_ids
    from specula.runtime.dataplane import RemoteDrafter
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.serve.verifier import VerifierEngine
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    path = resolve(model)
    processor = load_processor(path)
    target = load_target(path)
    eos = eos_ids(processor.tokenizer, target)
    prompts = encoded_prompts(processor, suites, n, seed)  # [(suite, id, EncodedPrompt)], the checkpoint's template
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    child = _DrafterProcess(drafter, str(path), predraft=predraft, core=pinned[1] if pinned else None)
    cores = {"verifier": sorted(_cores()), "drafter": child.cores, "pinned": bool(pinned)}
    engines = {}
    try:
        engines["plain"] = SpecEngine(target, None, eos_token_ids=eos)
        engines["single_process"] = SpecEngine(target, _make_drafter(drafter, str(path), target), gamma=gamma,
                                               eos_token_ids=eos)
        for name, settings in REMOTE.items():
            remote = RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=60.0, **settings)
            engines[name] = VerifierEngine(target, remote, gamma=gamma, eos_token_ids=eos)

        def once(name, rid, prompt):
            """(seconds, seconds to the first token, (tokens, metrics, dataplane)) of one request."""
            eng, req = engines[name], prompt.request(rid, params)
            t0 = time.perf_counter()
            first = None
            if isinstance(eng, VerifierEngine):
                tokens = []
                for chunk in eng.stream(req, drafter_address=child.address):
                    first = time.perf_counter() if first is None and chunk["tokens"] else first
                    tokens.extend(chunk["tokens"])
                if chunk["drafter"] != "ok":
                    raise RuntimeError(f"{name}: the drafter was not used: {chunk['drafter']}")
                res = (tokens, chunk["metrics"], chunk["dataplane"])
            else:
                for ev in eng.stream([req]):
                    first = time.perf_counter() if first is None and ev.tokens else first
                r = eng.finished.pop(rid)
                res = (r.tokens, r.metrics.to_dict(), None)
            t1 = time.perf_counter()
            return t1 - t0, (first if first is not None else t1) - t0, res

        _, wid, warm = prompts[0]
        for name in CONFIGS:  # warm-up: first calls allocate and pick kernels
            once(name, f"warm-{name}", warm)
        seconds, rows, reference = defaultdict(float), defaultdict(list), {}
        for i, (suite, pid, prompt) in enumerate(prompts):
            for name in CONFIGS:
                dt, ttft, (tokens, metrics, dp) = once(name, f"{pid}-{name}", prompt)
                seconds[name] += dt
                if name == "plain":
                    reference[pid] = tokens
                rows[name].append({"prompt": pid, "suite": suite, "seconds": dt, "first_token_s": ttft,
                                   "tokens": tokens, "metrics": metrics, "dataplane": dp,
                                   "exact": tokens == reference[pid]})
            log(f"prompt {i + 1}/{len(prompts)} ({pid}): " + ", ".join(
                f"{k} {rows[k][-1]['seconds']:.2f}s" for k in CONFIGS))
    finally:
        for e in engines.values():
            if isinstance(e, VerifierEngine):
                e.close()
        child.close()
    wire = _wire_bytes(target, prompts[0], gamma)
    return _summarize(dict(model=str(path), drafter=drafter, gamma=gamma, suites=list(suites), n_per_suite=n,
                           max_tokens=max_tokens, temperature=temperature, predraft=predraft, cores=cores),
                      seconds, rows, wire)


def _wire_bytes(target, prompt, gamma: int) -> dict:
    """Frame bytes per codec of the target features a drafter may ask for: the prompt's hidden states (Begin)
    and one block's (Verdict), taken from a real prefill of the first prompt."""
    from specula.runtime.wire import WireError, encode_message, pb
    from specula.runtime.wire.frames import Message
    _, _, encoded = prompt
    ids = encoded.input_ids  # [L]
    out = target.prefill([encoded.prefill("wire-probe")])
    target.release(["wire-probe"])
    hidden = out.features.hidden[0, : out.features.lengths[0]].float().cpu()  # [L, H]
    block = hidden[-(gamma + 1):].contiguous()  # [1 + gamma, H] a whole block accepted
    res = {}
    for codec in CODECS:
        try:
            begin = encode_message(Message("r", pb.Begin(prompt_ids=ids.tolist(), codec=codec), {"hidden": hidden}),
                                   codec=codec)
            verdict = encode_message(Message("r", pb.Verdict(accepted=list(range(gamma))), {"hidden": block}),
                                     codec=codec)
        except WireError as e:  # e.g. a compressor that is not installed
            res[codec] = {"error": str(e)}
            continue
        res[codec] = {"begin_bytes": sum(f.ByteSize() for f in begin),
                      "verdict_bytes": sum(f.ByteSize() for f in verdict)}
    base = res["fp32"]
    for c, r in res.items():
        if "error" not in r:
            r["ratio_vs_fp32"] = round((r["begin_bytes"] + r["verdict_bytes"])
                                       / (base["begin_bytes"] + base["verdict_bytes"]), 4)
    res["shapes"] = {"begin_hidden": list(hidden.shape), "verdict_hidden": list(block.shape)}
    return res


def _summarize(cfg: dict, seconds, rows, wire) -> dict:
    import torch

    plain_s = seconds["plain"]
    r = {"config": cfg, "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                    "torch": torch.__version__, "python": platform.python_version(),
                                    "processes": "verifier here, drafter in a child process, loopback gRPC"},
         "configs": {}}
    per_step, decode, critical = {}, {}, {}
    for name in CONFIGS:
        rs = rows[name]
        blocks = sum(x["metrics"]["blocks"] for x in rs)
        accepted = sum(x["metrics"]["accepted_tokens"] for x in rs)
        t = defaultdict(float)
        for x in rs:
            for k, v in x["metrics"]["time_s"].items():
                t[k] += v
        verify = t["verify"] + t["sample"] + t["commit"]
        first = sum(x["first_token_s"] for x in rs)  # prefill, vision and the drafter's Begin: once per request
        decode[name] = seconds[name] - first
        c = {"seconds": round(seconds[name], 4), "tokens": sum(len(x["tokens"]) for x in rs),
             "first_token_s": round(first, 4), "decode_s": round(decode[name], 4),
             "blocks": blocks, "tau": round((accepted + blocks) / blocks, 3) if blocks else None,
             "speedup_vs_plain": round(plain_s / seconds[name], 3) if seconds[name] else None,
             "greedy_exact": all(x["exact"] for x in rs) if cfg["temperature"] == 0 and name != "plain" else None,
             "verify_s": round(verify, 4),
             "critical_draft_s": round(t["draft"], 6),  # the verifier's time on the drafter, as it booked it
             "draft_begin_s": round(t["draft_begin"], 6)}  # its Begins (prefill of each prompt), once per request
        per_step[name] = verify / blocks if blocks else 0.0
        critical[name] = t["draft"] / blocks if blocks else 0.0  # what the verifier spent on the drafter per block
        dps = [x["dataplane"] for x in rs if x["dataplane"]]
        if dps:
            agg = {k: sum(d[k] for d in dps) for k in ("draft_s", "transfer_s", "idle_s", "ahead_s", "spec_used",
                                                       "spec_dropped", "spec_branch", "offers_taken", "proposals",
                                                       "bytes_out", "bytes_in", "early", "first_ahead")}
            step = seconds[name] / blocks if blocks else 0.0
            c.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in agg.items()})
            c["block_step_s"] = round(step, 5)
            c["decode_block_step_s"] = round(decode[name] / blocks, 5) if blocks else None  # after the first token
            c["time_split_per_block_s"] = {k: round(v / blocks, 5) for k, v in (
                ("verify", verify), ("draft", agg["draft_s"]), ("transfer", agg["transfer_s"]),
                ("idle", agg["idle_s"]), ("ahead_overlapped", agg["ahead_s"]))} if blocks else None
            c["transfer_share_of_block_step"] = round(agg["transfer_s"] / seconds[name], 4) if seconds[name] else None
            c["wire_bytes_per_block"] = round((agg["bytes_out"] + agg["bytes_in"]) / blocks, 1) if blocks else None
            c["codec"] = dps[0]["codec"]
        r["configs"][name] = c
    for name, c in r["configs"].items():  # the phase the drafter can speed up: after the first token
        c["decode_speedup_vs_plain"] = round(decode["plain"] / decode[name], 3) if decode[name] > 0 else None
    suites = defaultdict(list)
    for x in rows["plain"]:
        suites[x["suite"]].append(len(x["tokens"]))
    r["tokens_per_request"] = {k: round(sum(v) / len(v), 1) for k, v in suites.items()}
    t_decode = per_step["plain"]
    r["overlap"] = {"t_decode_s": round(t_decode, 6)}
    for name in ("single_process", *REMOTE):
        c = r["configs"][name]
        t_verify = per_step[name]
        ideal = c["tau"] * t_decode / t_verify if c["tau"] and t_verify else None
        c["ideal_speedup"] = round(ideal, 3) if ideal else None
        c["overlap_efficiency"] = round(c["speedup_vs_plain"] / ideal, 3) if ideal else None
        # the drafter's time on the verifier's critical path per block (asking for and waiting on the proposal,
        # sending the verdict), over a plain decoding step: what drafting adds to a block that overlap did not hide
        c["critical_draft_vs_t_decode"] = round(critical[name] / t_decode, 3) if t_decode else None
    p, s = r["configs"]["pipelined"], r["configs"]["sequential"]
    r["overlap"].update({"t_verify_gamma_s": round(per_step["pipelined"], 6),
                         "efficiency": p["overlap_efficiency"],
                         "pipelined_vs_sequential": round(s["seconds"] / p["seconds"], 3) if p["seconds"] else None,
                         "pipelined_vs_single_process": round(r["configs"]["single_process"]["seconds"]
                                                              / p["seconds"], 3) if p["seconds"] else None,
                         "predraft_vs_pipelined": round(p["seconds"] / r["configs"]["predraft"]["seconds"], 3)
                         if r["configs"]["predraft"]["seconds"] else None,
                         "decode_pipelined_vs_sequential": _ratio(decode["sequential"], decode["pipelined"]),
                         "decode_predraft_vs_sequential": _ratio(decode["sequential"], decode["predraft"]),
                         "decode_predraft_vs_pipelined": _ratio(decode["pipelined"], decode["predraft"]),
                         "offers_vs_predraft": _ratio(seconds["predraft"], seconds["offers"]),
                         "decode_offers_vs_predraft": _ratio(decode["predraft"], decode["offers"]),
                         "decode_offers_vs_sequential": _ratio(decode["sequential"], decode["offers"]),
                         "offers_vs_sequential": _ratio(seconds["sequential"], seconds["offers"])})
    r["wire"] = wire
    return r


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def render_markdown(r: dict) -> str:
    cfg = r["config"]
    lines = ["# Specula bench: distributed runtime, pipelined vs sequential vs single process", "",
             f"Model `{cfg['model']}`, drafter `{json.dumps(cfg['drafter'])}`, gamma {cfg['gamma']}, "
             f"{cfg['n_per_suite']} prompts per suite ({', '.join(cfg['suites'])}), max_tokens {cfg['max_tokens']}, "
             f"temperature {cfg['temperature']}; {r['machine']['cpu_count']} CPUs, verifier and drafter in separate "
             f"processes with one torch thread each, loopback gRPC ({_cores_md(cfg.get('cores'))}). Ratios are "
             "measured in this run, round robin.", "",
             "| config | tau | speedup vs plain | decode-phase speedup | ideal tau*T_decode/T_verify "
             "| overlap efficiency | drafter on the critical path / T_decode | greedy == plain |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, c in r["configs"].items():
        lines.append(f"| {name} | {c['tau'] or '-'} | {c['speedup_vs_plain']} | {c.get('decode_speedup_vs_plain')} | "
                     f"{c.get('ideal_speedup') or '-'} | {c.get('overlap_efficiency') or '-'} | "
                     f"{c.get('critical_draft_vs_t_decode') or '-'} | "
                     f"{c['greedy_exact'] if c['greedy_exact'] is not None else '-'} |")
    o = r["overlap"]
    per_suite = ", ".join(f"{k} {v}" for k, v in r.get("tokens_per_request", {}).items())
    lines += ["", f"Pipelined vs sequential (same drafter, same wire): **{o['pipelined_vs_sequential']}x** end to end, "
                  f"**{o.get('decode_pipelined_vs_sequential')}x** in the decode phase (after the first token: "
                  f"prefill, vision and the drafter's Begin left out); pipelined vs single process: "
                  f"{o['pipelined_vs_single_process']}x; with predraft ({cfg.get('predraft')} rejection blocks) vs "
                  f"pipelined: {o.get('predraft_vs_pipelined')}x end to end, {o.get('decode_predraft_vs_pipelined')}x "
                  f"in the decode phase (predraft vs sequential: {o.get('decode_predraft_vs_sequential')}x); with "
                  f"offers (predraft, blocks sent unasked) vs sequential: **{o.get('offers_vs_sequential')}x** end "
                  f"to end, **{o.get('decode_offers_vs_sequential')}x** in the decode phase (vs predraft: "
                  f"{o.get('decode_offers_vs_predraft')}x). Tokens per request (plain): {per_suite}.", "",
              "## Time per block step (seconds, verifier's view)", "",
              "| config | step | decode step | verify | draft (critical path) | transfer | idle | "
              "drafted ahead (overlapped) | transfer share | blocks drafted ahead used / dropped (used for a rejection) "
              "| taken as offers | first blocks ready / early Begins |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for name in REMOTE:
        c = r["configs"][name]
        ts = c.get("time_split_per_block_s") or {}
        lines.append(f"| {name} | {c.get('block_step_s')} | {c.get('decode_block_step_s')} | {ts.get('verify')} | "
                     f"{ts.get('draft')} | {ts.get('transfer')} | {ts.get('idle')} | {ts.get('ahead_overlapped')} | "
                     f"{c.get('transfer_share_of_block_step')} | {c.get('spec_used')} / {c.get('spec_dropped')} "
                     f"({c.get('spec_branch')}) | {c.get('offers_taken')} | "
                     f"{c.get('first_ahead')} / {c.get('early')} |")
    w = r["wire"]
    lines += ["", f"## Wire bytes per codec (target features as frames: prompt hidden {w['shapes']['begin_hidden']}, "
                  f"block hidden {w['shapes']['verdict_hidden']})", "",
              "| codec | Begin bytes | Verdict bytes | vs fp32 |", "| --- | ---: | ---: | ---: |"]
    for codec in CODECS:
        x = w.get(codec, {})
        if "error" in x:
            lines.append(f"| {codec} | - | - | {x['error']} |")
        else:
            lines.append(f"| {codec} | {x['begin_bytes']} | {x['verdict_bytes']} | {x['ratio_vs_fp32']} |")
    p = r["configs"]["pipelined"]
    lines += ["", f"Session traffic measured in the pipelined run ({p.get('codec')} negotiated, the drafter's needs "
                  f"only): {p.get('wire_bytes_per_block')} bytes per block."]
    return "\n".join(lines) + "\n"


def _cores_md(cores: dict | None) -> str:
    if not cores:
        return "cores not recorded"
    if cores.get("pinned"):
        return f"verifier pinned to core {cores['verifier']}, drafter to core {cores['drafter']}"
    return f"both on cores {cores['verifier']}"


def write_report(r: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_distributed.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "bench_distributed.md").write_text(render_markdown(r))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    p.add_argument("--drafter", default=None, help='drafter kind or JSON config (default: text_lm if shipped, '
                                                   'else ngram), e.g. \'{"kind": "ngram", "max_n": 3}\'')
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per block (default: 4)")
    p.add_argument("--suite", action="append", default=[], help="evaluation suite, repeatable")
    p.add_argument("--n", type=int, default=None, help="prompts per suite (default: 6; --quick: 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: 64; --quick: 24)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--quick", action="store_true", help="few prompts, few tokens: a few minutes")
    p.add_argument("--predraft", type=int, default=3,
                   help="blocks drafted per block for the likeliest rejections in the predraft config (default: 3)")
    p.add_argument("--pin-cores", action="store_true",
                   help="run the verifier on one CPU core and the drafter process on another (Linux, 2+ cores), as "
                        "on separate devices; default: both processes share every core")
    p.add_argument("--out", default="reports/bench-distributed", help="output directory for JSON + markdown")


def main(args) -> int:
    drafter = default_drafter() if not args.drafter else (
        json.loads(args.drafter) if args.drafter.strip().startswith("{") else {"kind": args.drafter})
    suites = tuple(args.suite) or (QUICK["suites"] if args.quick else ("caption", "vqa", "reasoning", "chart",
                                                                       "text"))
    n = args.n if args.n is not None else (QUICK["n"] if args.quick else 6)
    max_tokens = args.max_tokens if args.max_tokens is not None else (QUICK["max_tokens"] if args.quick else 64)
    if args.predraft < 0:
        raise SystemExit("--predraft must be >= 0")
    r = run(args.model, drafter, args.gamma, suites, n, max_tokens, args.temperature, predraft=args.predraft,
            pin_cores=args.pin_cores)
    out = write_report(r, args.out)
    print(render_markdown(r))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the drafter process of `specula bench distributed`")
    ap.add_argument("--serve-drafter", required=True, help="drafter config as JSON")
    ap.add_argument("--model", required=True)
    ap.add_argument("--predraft", type=int, default=3)
    ap.add_argument("--core", type=int, default=None)
    a = ap.parse_args()
    serve_drafter(json.loads(a.serve_drafter), a.model, a.predraft, a.core)
