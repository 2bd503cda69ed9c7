"""``specula bench spec``: speculative decoding vs plain decoding, measured side by side in one run.

For every prompt (evaluation suites, batch 1, greedy by default) the configurations run one after another, round
robin, so machine drift hits them alike:
  plain      our engine with no drafter (gamma 0): the reference output and the time every speedup divides
  hf         HF ``generate`` on the same checkpoint, loaded as its own stock class (greedy)
  <drafter>  our engine with each drafter at each gamma
  hf_assisted  HF assisted generation (``assistant_model``) with the text_lm drafter's model, when it can run
Speedup = plain wall time / configuration wall time over the same prompts. Greedy outputs are checked against
plain decoding token for token (``exact`` in the report). Writes JSON, markdown and PNG plots.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.metrics import aggregate
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.bench.plots import bar_chart, line_chart
from specula.runtime.core.sampling import SamplingParams

BENCH_OFFSET = 30_000  # evaluation-split indices used by benchmarks


@dataclass(frozen=True)
class BenchConfig:
    model: str = "target"
    drafters: tuple[dict, ...] = ({"kind": "ngram"},)
    suites: tuple[str, ...] = ("caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text")
    n_per_suite: int = 6
    gammas: tuple[int, ...] = (5,)
    max_tokens: int = 64
    temperature: float = 0.0
    hf_baselines: bool = True
    out: str = "reports/bench-spec"
    seed: int = 0
    device: str = "cpu"  # the target's (and by default the drafters') device: cpu, cuda or cuda:N
    extra: dict = field(default_factory=dict)


def encoded_prompts(processor, suites, n, seed):
    """``n`` evaluation-split prompts per suite through the checkpoint's chat template and processor
    (runtime/engine/prompts.py): ``[(suite, prompt_id, EncodedPrompt)]``."""
    from specula.runtime.engine.prompts import encode_prompt
    from specula.world import generate

    out = []
    for suite in suites:
        for i in range(n):
            s = generate(suite, "eval", BENCH_OFFSET + i, seed)
            out.append((suite, f"{suite}-{i}", encode_prompt(processor, s.prompt, s.images)))
    return out


def bench_prompts(processor, suites, n, seed):
    """``encoded_prompts`` as ``[(suite, prompt_id, input_ids [L], pixel_values | None)]`` (LLaVA targets: a
    Qwen2.5-VL prompt also needs its ``image_grid_thw``, which only ``encoded_prompts`` keeps)."""
    return [(suite, pid, *p) for suite, pid, p in encoded_prompts(processor, suites, n, seed)]


_prompts = bench_prompts  # the name earlier callers used


def config_label(config: dict) -> str:
    """How a drafter config is named in reports: its ``label`` if given, else its kind (+ "/tree" for trees)."""
    if "label" in config:
        return str(config["label"])
    return config["kind"] + ("/tree" if config.get("structure") == "tree" else "")


def make_drafter(config: dict, target, tokenizer=None):
    """Build a drafter from ``{"kind": ..., <options>}``, its resources from ``target`` (engine/local_drafter.py)."""
    from specula.runtime.engine.local_drafter import build_local_drafter

    return build_local_drafter(config, target, tokenizer)


def _hf_assistant(drafters):
    """The text_lm drafter's HF model for assisted generation, or the reason there is none."""
    for d in drafters:
        if d.spec.kind == "text_lm" and hasattr(d, "model"):
            return d.model, None
    return None, "no text_lm drafter in this run (HF assisted generation needs a small LM with the same tokenizer)"


def load(model: str, device: str = "cpu"):
    """(path, processor, our target, the stock HF model) for ``model`` (a zoo name or a local directory), both
    models on ``device``."""
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    path = resolve(model)
    target = load_target(str(path), device=device)
    # the checkpoint's own HF class (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration), as
    # load_target picked it from config.json's model_type
    hf_model = type(target).hf_class.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    return path, load_processor(path), target, hf_model


def run(cfg: BenchConfig, log=print, loaded=None) -> dict:
    """Measure ``cfg``; ``loaded`` is ``load(cfg.model)`` when the caller already holds the models."""
    labels = [config_label(d) for d in cfg.drafters]
    clash = sorted({x for x in labels if labels.count(x) > 1})
    if clash:  # their rows would overwrite each other in every table
        raise ValueError(f"bench spec: drafter configs {clash} appear more than once under the same name; give each a "
                         f"\"label\" (e.g. {{\"kind\": \"text_lm\", \"lean\": false, \"label\": \"text_lm-stock\"}})")
    path, processor, target, hf_model = loaded if loaded is not None else load(cfg.model, cfg.device)
    tok = processor.tokenizer
    drafters = [(d, make_drafter(d, target, tok)) for d in cfg.drafters]
    eos = eos_ids(tok, target)
    engines = {"plain": SpecEngine(target, None, eos_token_ids=eos)}
    for d, drafter in drafters:
        for g in cfg.gammas:
            engines[f"{config_label(d)}@{g}"] = SpecEngine(target, drafter, gamma=g, eos_token_ids=eos)
    assistant, assisted_reason = _hf_assistant([x for _, x in drafters])
    prompts = encoded_prompts(processor, cfg.suites, cfg.n_per_suite, cfg.seed)
    params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed, max_tokens=cfg.max_tokens)
    hf_kw = dict(max_new_tokens=cfg.max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)

    times: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # config -> suite -> s
    tokens_out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    metrics: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    exact: dict[str, list[bool]] = defaultdict(list)
    reference: dict[str, list[int]] = {}

    # warm-up: one request through every configuration (first calls allocate and pick kernels)
    _, wid, warm = prompts[0]
    for name, eng in engines.items():
        eng.generate([warm.request(f"warm-{name}", params)])
    with torch.no_grad():
        for suite, pid, prompt in tqdm(prompts, desc="bench spec", unit="prompt", mininterval=2.0):
            ids = prompt.input_ids  # [L]
            for name, eng in engines.items():
                t0 = time.perf_counter()
                res = eng.generate([prompt.request(f"{pid}-{name}", params)])
                dt = time.perf_counter() - t0
                r = next(iter(res.values()))
                times[name][suite] += dt
                tokens_out[name][suite] += len(r.tokens)
                metrics[name][suite].append(r.metrics)
                if name == "plain":
                    reference[pid] = r.tokens
                else:
                    exact[name].append(r.tokens == reference[pid])
            if cfg.hf_baselines:
                kw = prompt.hf_inputs(cfg.device)  # input_ids [1, L], pixels, Qwen's grid and mm_token_type_ids
                t0 = time.perf_counter()
                out = hf_model.generate(**kw, **hf_kw)
                times["hf"][suite] += time.perf_counter() - t0
                tokens_out["hf"][suite] += out.shape[1] - len(ids)
                if assistant is not None:
                    try:
                        t0 = time.perf_counter()
                        out = hf_model.generate(assistant_model=assistant, **kw, **hf_kw)
                        times["hf_assisted"][suite] += time.perf_counter() - t0
                        tokens_out["hf_assisted"][suite] += out.shape[1] - len(ids)
                    except Exception as e:  # record exactly why HF could not do it, and go on
                        assisted_reason = f"{type(e).__name__}: {e}"
                        assistant = None
    return _summarize(cfg, path, times, tokens_out, metrics, exact, assisted_reason)


def _summarize(cfg, path, times, tokens_out, metrics, exact, assisted_reason) -> dict:
    suites = list(cfg.suites)
    result = {"config": asdict(cfg), "model": str(path), "machine": {
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version()}, "configs": {}, "hf_assisted_note": assisted_reason}
    plain_total = sum(times["plain"].values())
    for name in list(times):
        has_metrics = any(metrics[name][s] for s in suites) if name in metrics else False
        per_suite = {}
        for s in suites:
            m = aggregate(metrics[name][s]) if metrics[name][s] else None
            per_suite[s] = {
                "seconds": round(times[name][s], 4),
                "tokens": tokens_out[name][s],
                "speedup_vs_plain": round(times["plain"][s] / times[name][s], 3) if times[name][s] else None,
                **({"tau": round(m.tau, 3), "alpha": [round(a, 3) for a in m.alpha[:8]]} if m else {}),
            }
        total = sum(times[name].values())
        allm = aggregate([x for s in suites for x in metrics[name][s]]) if has_metrics else None
        result["configs"][name] = {
            "suites": per_suite, "seconds": round(total, 4),
            "tokens_per_s": round(sum(tokens_out[name].values()) / total, 2) if total else None,
            "speedup_vs_plain": round(plain_total / total, 3) if total else None,
            "tau": round(allm.tau, 3) if allm else None,
            "alpha": [round(a, 3) for a in allm.alpha[:8]] if allm else None,
            "time_split_s": {k: round(v, 4) for k, v in allm.time.items()} if allm else None,
            "greedy_exact": (all(exact[name]) if exact[name] else None) if cfg.temperature == 0 else None,
        }
    return result


def render_markdown(r: dict) -> str:
    suites = list(r["config"]["suites"])
    lines = [f"# Specula bench: speculative vs plain decoding", "",
             f"Model `{r['model']}`, {r['machine']['cpu_count']} CPUs, {r['machine']['torch_threads']} torch threads, "
             f"torch {r['machine']['torch']}; {r['config']['n_per_suite']} prompts per suite, max_tokens "
             f"{r['config']['max_tokens']}, temperature {r['config']['temperature']}. Speedup = plain engine time / "
             "configuration time, same prompts, same run (round robin).", "",
             "| config | tau | speedup vs plain | tokens/s | greedy output == plain |", "| --- | ---: | ---: | ---: | --- |"]
    for name, c in r["configs"].items():
        lines.append(f"| {name} | {c['tau'] if c['tau'] is not None else '-'} | {c['speedup_vs_plain']} | "
                     f"{c['tokens_per_s']} | {c['greedy_exact'] if c['greedy_exact'] is not None else '-'} |")
    lines += ["", "## tau / speedup per suite", "", "| config | " + " | ".join(suites) + " |",
              "| --- | " + " | ".join("---:" for _ in suites) + " |"]
    for name, c in r["configs"].items():
        cells = [f"{c['suites'][s].get('tau', '-')} / {c['suites'][s]['speedup_vs_plain']}x" for s in suites]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## alpha_n (acceptance rate of draft position n)", ""]
    for name, c in r["configs"].items():
        if c["alpha"]:
            lines.append(f"- {name}: " + ", ".join(f"{a:.2f}" for a in c["alpha"]))
    if r.get("hf_assisted_note"):
        lines += ["", f"HF assisted generation: {r['hf_assisted_note']}"]
    return "\n".join(lines) + "\n"


def write_report(r: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_spec.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "bench_spec.md").write_text(render_markdown(r))
    suites = list(r["config"]["suites"])
    spec = {n: c for n, c in r["configs"].items() if c["tau"] is not None and n != "plain"}
    if spec:
        bar_chart(out / "tau_per_suite.png", "tau per suite", suites,
                  {n: [c["suites"][s].get("tau", 0.0) or 0.0 for s in suites] for n, c in spec.items()}, "tau")
        depth = max(len(c["alpha"] or []) for c in spec.values())
        if depth:
            line_chart(out / "alpha_n.png", "alpha_n: acceptance per draft position", list(range(1, depth + 1)),
                       {n: (c["alpha"] + [0.0] * depth)[:depth] for n, c in spec.items()}, "alpha", "position n")
        by_kind: dict[str, dict[int, float]] = defaultdict(dict)
        for n, c in spec.items():
            if "@" in n:
                kind, g = n.rsplit("@", 1)
                by_kind[kind][int(g)] = c["speedup_vs_plain"]
        gammas = sorted({g for v in by_kind.values() for g in v})
        if gammas:
            line_chart(out / "speedup_vs_gamma.png", "speedup vs plain decoding by gamma", gammas,
                       {k: [v.get(g, 0.0) for g in gammas] for k, v in by_kind.items()}, "speedup", "gamma")
    return out


def main(args) -> int:
    drafters = tuple(json.loads(d) if d.strip().startswith("{") else {"kind": d} for d in (args.drafter or ["ngram"]))
    cfg = BenchConfig(model=args.model, drafters=drafters, suites=tuple(args.suite or BenchConfig.suites),
                      n_per_suite=args.n, gammas=tuple(args.gamma or [5]), max_tokens=args.max_tokens,
                      temperature=args.temperature, hf_baselines=not args.no_hf, out=args.out,
                      device=getattr(args, "device", "cpu"))
    r = run(cfg)
    out = write_report(r, cfg.out)
    print(render_markdown(r))
    print(f"wrote {out}")
    return 0
