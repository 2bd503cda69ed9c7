"""One function per section of ``specula bench report``; each takes the run's ``Ctx`` and returns a JSON dict.

Every section returns ``{"status": "ok", ...}`` with its numbers, or ``{"status": "not_measured", "reason": ...}``
when this checkout cannot measure it; ``runtime/bench/report/run.py`` turns an exception into ``"failed"`` with the
reason, so one section never takes the report down. Sections that need "the best drafter" take the one with the
highest overall speedup in the main section (it runs first).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.bench.report.measure import Prompt, prompt_params, round_robin, stats, summarize
from specula.runtime.core.sampling import SamplingParams


@dataclass
class Ctx:
    cfg: object  # bench_report.ReportConfig
    path: Path
    processor: object
    target: object
    hf_model: object
    found: object  # drafters.Found
    eos: list[int]
    state: dict = field(default_factory=dict)  # what later sections reuse: main runs and prompts, best drafter
    workdir: Path | None = None  # the report folder, for sections that leave files (reliability)

    def engines(self, drafters, gamma: int, suffix: str = "") -> dict:
        out = {"plain": SpecEngine(self.target, None, eos_token_ids=self.eos)}
        for a in drafters:
            out[a.label + suffix] = SpecEngine(self.target, a.drafter, gamma=gamma, eos_token_ids=self.eos)
        return out

    def params(self, temperature: float = 0.0) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=self.cfg.seed, max_tokens=self.cfg.max_tokens)

    def secondary(self) -> list:
        """The drafters of the sections after the main one: all of them, or (``cfg.every_variant`` False) one
        variant per kind, the chain or tree with the higher overall speedup in the main section; the ensemble as
        IbED publishes it (``join: at_once``) counts as a kind of its own, as its claim reads its multi-image run."""
        configs = self.state.get("main_configs")
        if self.cfg.every_variant or not configs:
            return list(self.found.available)
        best: dict = {}
        for a in self.found.available:
            s = (configs.get(a.label) or {}).get("all") or {}
            score = s.get("speedup_vs_plain") or 0.0
            kind = a.kind + ("/at_once" if a.config.get("join") == "at_once" else "")
            if kind not in best or score > best[kind][0]:
                best[kind] = (score, a)
        return [a for _, a in best.values()]

    @property
    def overlap_drafter(self):
        """The drafter the overlap section pipelines: the one with the highest overall speedup in the main section
        among those that can draft ahead (``Lookahead`` chains) and whose drafting costs time to hide (not ngram,
        whose drafting is a table lookup); the best drafter when none qualifies."""
        from specula.drafters.protocol import supports_lookahead

        configs = self.state.get("main_configs") or {}

        def score(a) -> float:
            return ((configs.get(a.label) or {}).get("all") or {}).get("speedup_vs_plain") or 0.0

        able = [a for a in self.found.available if a.kind not in FREE_DRAFTING and supports_lookahead(a.drafter)]
        return max(able, key=score) if able else self.best

    @property
    def best(self):
        """The best drafter of the main section (highest overall speedup), or None."""
        label = self.state.get("best")
        return next((a for a in self.found.available if a.label == label), None)


FREE_DRAFTING = ("ngram", "random")  # kinds whose drafting costs next to nothing: nothing for the overlap to hide


def not_measured(reason: str, **extra) -> dict:
    return {"status": "not_measured", "reason": reason, **extra}


def suite_prompts(ctx: Ctx, suites, n: int) -> list[Prompt]:
    from specula.runtime.bench.spec import encoded_prompts

    return [Prompt(s, pid, p.input_ids, p.pixel_values, p.image_grid_thw)
            for s, pid, p in encoded_prompts(ctx.processor, suites, n, ctx.cfg.seed)]


def visual(suites) -> list[str]:
    return [s for s in suites if s != "text"]


# ----------------------------------------------------------------------------------------------------- sections


def main_table(ctx: Ctx) -> dict:
    """tau and speedup per drafter x suite, greedy, batch 1, one gamma: the shape of the papers' main tables."""
    cfg = ctx.cfg
    prompts = suite_prompts(ctx, cfg.suites, cfg.n_per_suite)
    runs = round_robin(ctx.engines(ctx.found.available, cfg.gamma), prompts, ctx.params(0.0), desc="main T=0")
    configs = summarize(runs, list(cfg.suites), {"visual": visual(cfg.suites)})
    spec = {k: v for k, v in configs.items() if k != "plain"}
    best = max(spec, key=lambda k: spec[k]["all"]["speedup_vs_plain"] or 0.0) if spec else None
    ctx.state.update(main_runs=runs, main_prompts=prompts, main_configs=configs, best=best)
    return {"status": "ok", "temperature": 0.0, "gamma": cfg.gamma, "suites": list(cfg.suites),
            "visual_suites": visual(cfg.suites), "n_per_suite": cfg.n_per_suite, "max_tokens": cfg.max_tokens,
            "configs": configs, "best": best,
            "greedy_exact": all(v["all"].get("exact", True) for v in spec.values()) if spec else None}


def temperature(ctx: Ctx) -> dict:
    """tau and speedup at temperature 0 (from the main section) and 1 (plain sampling is the reference)."""
    cfg = ctx.cfg
    suites = list(cfg.temperature_suites)
    prompts = suite_prompts(ctx, suites, cfg.temperature_n)
    runs = round_robin(ctx.engines(ctx.secondary(), cfg.gamma), prompts, ctx.params(1.0), desc="T=1")
    t1 = {k: v["all"] for k, v in summarize(runs, suites).items()}
    main = ctx.state.get("main_runs")
    shared = [s for s in suites if main is not None and s in main.seconds.get("plain", {})]
    t0 = {k: stats(main, k, shared) for k in main.seconds if k in runs.seconds} if shared else None
    return {"status": "ok", "suites": suites, "n_per_suite": cfg.temperature_n, "gamma": cfg.gamma,
            "by_temperature": {"0": t0, "1": t1},
            "note": "temperature 1 speedups divide plain sampling's wall time; distributions are checked by the "
                    "statistical tests, here only tau and speed"
                    + ("" if t0 else "; temperature 0 not available (main section did not run these suites)")}


def gamma_sweep(ctx: Ctx) -> dict:
    cfg = ctx.cfg
    drafters = ctx.secondary() if cfg.gamma_all_drafters else [d for d in [ctx.best] if d is not None]
    if not drafters:
        return not_measured("no drafter available")
    engines = {"plain": SpecEngine(ctx.target, None, eos_token_ids=ctx.eos)}
    for a in drafters:
        for g in cfg.gammas:
            engines[f"{a.label}@{g}"] = SpecEngine(ctx.target, a.drafter, gamma=g, eos_token_ids=ctx.eos)
    suites = list(cfg.gamma_suites)
    runs = round_robin(engines, suite_prompts(ctx, suites, cfg.gamma_n), ctx.params(0.0), desc="gamma sweep")
    configs = {k: v["all"] for k, v in summarize(runs, suites).items()}
    table = {a.label: {str(g): configs[f"{a.label}@{g}"] for g in cfg.gammas} for a in drafters}
    return {"status": "ok", "suites": suites, "n_per_suite": cfg.gamma_n, "gammas": list(cfg.gammas),
            "plain": configs["plain"], "drafters": table}


def multi_image_prompts(ctx: Ctx, k: int, n: int) -> list[Prompt]:
    """``n`` prompts with ``k`` images each: the world's multi-image sets ("describe the images in order", the
    longest answers, so tau has tokens to count), seeded by (k, i, seed) and disjoint from every split."""
    from specula.runtime.engine.prompts import encode_prompt
    from specula.world.image_sets import make_multi

    out = []
    for i in range(n):
        s = make_multi(random.Random(f"specula-report/multi/{k}/{i}/{ctx.cfg.seed}"), "multi_image", "caption", k=k)
        p = encode_prompt(ctx.processor, s.prompt, s.images)
        out.append(Prompt(f"k={k}", f"k{k}-{i}", p.input_ids, p.pixel_values, p.image_grid_thw))
    return out


def multi_image(ctx: Ctx) -> dict:
    cfg = ctx.cfg
    prompts = [p for k in cfg.image_counts for p in multi_image_prompts(ctx, k, cfg.images_n)]
    groups = [f"k={k}" for k in cfg.image_counts]
    runs = round_robin(ctx.engines(ctx.secondary(), cfg.gamma), prompts, ctx.params(0.0), desc="images 1-5")
    configs = summarize(runs, groups)
    lengths = {g: round(sum(len(p.input_ids) for p in prompts if p.group == g) / cfg.images_n) for g in groups}
    return {"status": "ok", "image_counts": list(cfg.image_counts), "n_per_count": cfg.images_n,
            "gamma": cfg.gamma, "prompt_tokens": lengths, "configs": configs}


def concurrency(ctx: Ctx) -> dict:
    """Throughput with N requests decoding at once through one SpecEngine (continuous batching)."""
    cfg = ctx.cfg
    prompts = ctx.state.get("main_prompts") or suite_prompts(ctx, cfg.suites, 1)
    ref = ctx.state["main_runs"].outputs.get("plain", {}) if "main_runs" in ctx.state else {}
    names = ["plain"] + ([ctx.best.label] if ctx.best is not None else [])
    engines = ctx.engines([ctx.best] if ctx.best is not None else [], cfg.gamma)
    params = ctx.params(0.0)
    rows: dict = {n: {} for n in names}
    counter = 0
    for li, level in enumerate(cfg.streams):
        batch = [prompts[j % len(prompts)] for j in range(level)]
        for name in (names if li % 2 == 0 else names[::-1]):  # alternate who goes first
            reqs = []
            for j, p in enumerate(batch):
                counter += 1
                reqs.append(p.request(f"conc-{counter}", prompt_params(params, j)))
            t0 = time.perf_counter()
            res = engines[name].generate(reqs)
            dt = time.perf_counter() - t0
            toks = [res[r.request_id].tokens for r in reqs]
            same = sum(ref.get(p.pid) == t for p, t in zip(batch, toks))
            rows[name][str(level)] = {"seconds": round(dt, 4), "tokens": sum(map(len, toks)),
                                      "tokens_per_s": round(sum(map(len, toks)) / dt, 2) if dt else None,
                                      "equal_to_single_request": f"{same}/{level}" if ref else None}
    return {"status": "ok", "streams": list(cfg.streams), "gamma": cfg.gamma, "configs": rows,
            "note": "one SpecEngine, all streams submitted at once (batched verification); tokens/s = all "
                    "streams' tokens / wall time" + ("" if ctx.best else "; no drafter available: plain only")}


def hf_comparison(ctx: Ctx) -> dict:
    """Plain HF ``generate`` and HF assisted generation vs our engine, through ``bench spec``'s own loop."""
    from specula.runtime.bench.spec import BenchConfig, run

    cfg = ctx.cfg
    drafters = [ctx.best.config] if ctx.best is not None else []
    text_lm = next((a for a in ctx.found.available if a.kind == "text_lm" and a.structure == "chain"), None)
    if text_lm is not None and text_lm.config not in drafters:
        drafters.append(text_lm.config)
    bc = BenchConfig(model=str(ctx.path), drafters=tuple(drafters), suites=tuple(cfg.hf_suites),
                     n_per_suite=cfg.hf_n, gammas=(cfg.gamma,), max_tokens=cfg.max_tokens, temperature=0.0,
                     hf_baselines=True, out="", seed=cfg.seed)
    r = run(bc, loaded=(ctx.path, ctx.processor, ctx.target, ctx.hf_model))
    cs = r["configs"]
    hf = cs.get("hf", {}).get("seconds")
    assisted = cs.get("hf_assisted", {}).get("seconds")
    rows = {}
    for name, c in cs.items():
        s = c["seconds"]
        rows[name] = {"seconds": s, "tokens_per_s": c["tokens_per_s"], "speedup_vs_plain": c["speedup_vs_plain"],
                      "speedup_vs_hf_generate": round(hf / s, 3) if hf and s else None,
                      "speedup_vs_hf_assisted": round(assisted / s, 3) if assisted and s else None,
                      "tau": c["tau"], "greedy_exact": c["greedy_exact"]}
    return {"status": "ok", "suites": list(cfg.hf_suites), "n_per_suite": cfg.hf_n, "gamma": cfg.gamma,
            "configs": rows, "hf_assisted": "measured" if "hf_assisted" in cs else r["hf_assisted_note"],
            "packed_linears": getattr(ctx.target, "linears_packed", 0)}


def target_costs(ctx: Ctx) -> dict:
    """T_decode, T_verify(gamma) / T_decode, prefill and vision encode (``bench target``)."""
    from specula.runtime.bench.target import world_prompts
    from specula.runtime.bench.target_timing import bench_target

    cfg = ctx.cfg
    fn = None
    if ctx.target.info.model_type == "llava" and (ctx.path / "processor_config.json").exists():
        fn = lambda: world_prompts(ctx.target, ctx.processor)  # noqa: E731
    r = bench_target(ctx.target, prompts_fn=fn, gammas=range(1, cfg.target_max_gamma + 1),
                     repeats=cfg.target_repeats, warmup=1, prefill_repeats=max(2, cfg.target_repeats // 4))
    return {"status": "ok", **r}


def wire(ctx: Ctx) -> dict:
    """Bytes on the wire per codec for what the verifier and drafter exchange (``runtime/bench/wire.py``)."""
    from specula.runtime.bench.wire import bench_codecs

    info = ctx.target.info
    g, H = ctx.cfg.gamma, info.hidden_size
    shapes = {f"hidden block [{g + 1}, {H}]": (g + 1, H)}
    if info.visual_tokens_per_image:
        shapes[f"visual, 1 image [{info.visual_tokens_per_image}, {H}]"] = (info.visual_tokens_per_image, H)
    shapes[f"last-layer KV block [2, {info.num_kv_heads}, {g + 1}, {info.head_dim}]"] = \
        (2, info.num_kv_heads, g + 1, info.head_dim)
    r = bench_codecs(list(shapes.values()), list(ctx.cfg.codecs), repeats=ctx.cfg.wire_repeats, seed=ctx.cfg.seed)
    keys = {"x".join(map(str, s)): name for name, s in shapes.items()}
    rows = {codec: {keys[k]: {kk: (round(vv, 6) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                    for k, v in by_shape.items()} for codec, by_shape in r.items()}
    return {"status": "ok", "shapes": list(shapes), "codecs": rows}


def overlap(ctx: Ctx) -> dict:
    """Overlap efficiency of the distributed runtime: ``bench distributed``'s own run (verifier here, the drafter in
    a child process over loopback gRPC; plain / single process / sequential / pipelined) with ``Ctx.overlap_drafter``."""
    try:
        from specula.runtime.bench import distributed as bench_distributed
    except ImportError:
        return not_measured("specula bench distributed (runtime/bench/distributed.py) is not in this checkout")
    cfg = ctx.cfg
    chosen = ctx.overlap_drafter
    drafter = {k: v for k, v in (chosen.config if chosen is not None else {"kind": "ngram"}).items() if k != "label"}
    r = bench_distributed.run(str(ctx.path), drafter=drafter, gamma=cfg.gamma, suites=tuple(cfg.overlap_suites),
                              n=cfg.overlap_n, max_tokens=cfg.max_tokens, temperature=0.0, seed=cfg.seed,
                              log=lambda *_: None)
    keep = ("seconds", "decode_s", "tau", "speedup_vs_plain", "decode_speedup_vs_plain", "ideal_speedup",
            "overlap_efficiency", "critical_draft_vs_t_decode", "greedy_exact", "transfer_share_of_block_step",
            "wire_bytes_per_block", "spec_used", "spec_dropped", "spec_branch", "codec")
    return {"status": "ok", "drafter": drafter, "suites": list(cfg.overlap_suites), "n_per_suite": cfg.overlap_n,
            "gamma": cfg.gamma, "overlap": r["overlap"],
            "configs": {n: {k: c[k] for k in keep if k in c} for n, c in r["configs"].items()}}


def served(ctx: Ctx) -> dict:
    """The served runtime (``bench served``): ``specula serve`` with the default config for ``ctx.path`` and with
    gamma 0, each on its own local Ray, driven over HTTP with the openai client round robin with in-process decoding
    (the other apps frozen while one runs); the servers' logs go to a temporary folder, the figures to the report."""
    import argparse
    import shutil
    import tempfile

    import torch

    from specula.runtime.bench import served as bench_served

    cfg = ctx.cfg
    logs = tempfile.mkdtemp(prefix="specula-served-")
    args = argparse.Namespace(config=None, model=str(ctx.path), suite=list(cfg.served_suites), n=cfg.served_n,
                              max_tokens=cfg.max_tokens, concurrency=list(cfg.served_streams), num_cpus=None,
                              threads=torch.get_num_threads(), seed=cfg.seed, out=logs, beside_ray=True)
    try:
        r = bench_served.run(args, log=lambda *_: None)
    finally:
        torch.set_num_threads(args.threads)
        shutil.rmtree(logs, ignore_errors=True)
    return {"status": "ok", "drafter": r["drafter"], "gamma": r["gamma"], "text_only": r.get("text_only"),
            "suites": r["suites"],
            "n_per_suite": r["n_per_suite"], "concurrency": r["concurrency"], "rows": r["rows"]}


def reliability(ctx: Ctx) -> dict:
    """The reliability and security suite's figures (``--reliability``): pytest in a child process from the
    checkout, each test's figure collected from $SPECULA_FIGURES_OUT (``report/reliability.py``)."""
    from specula.runtime.bench.report.reliability import repo_root, run_suite

    root = repo_root()
    if root is None:
        return not_measured("tests not found: no checkout beside the installed package (the suite lives in tests/)")
    return run_suite(root, ctx.cfg.reliability_tests, ctx.workdir or Path("."), ctx.cfg.reliability_timeout_s)
