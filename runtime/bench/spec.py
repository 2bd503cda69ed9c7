"""``specula bench spec``: speculative decoding vs plain decoding, measured side by side in one run.

For every prompt (evaluation suites, batch 1, greedy by default) the configurations run one after another, round
robin, so machine drift hits them alike:
  plain      our engine with no drafter (gamma 0): the reference output and the time every speedup divides
  hf         HF ``generate`` on the same checkpoint, loaded as its own stock class (greedy)
  <drafter>  our engine with each drafter at each gamma
  hf_assisted  HF assisted generation (``assistant_model``) with the text_lm drafter's model, when it can run
Speedup = plain wall time / configuration wall time over the same prompts. Greedy outputs are checked against
plain decoding token for token (``greedy_exact`` per configuration, ``exact`` per prompt row). Writes JSON, markdown
and PNG plots.

Prompts: ``n_per_suite`` world prompts of each suite, and/or the user's own (``--prompts FILE``: a prompts file or a
conversation file, runtime/bench/prompt_file.py), the first ``n_per_suite`` of each of the file's suite labels. With
``hf_baselines`` off (``--no-hf``) nothing is loaded but the target (the report's ``loaded`` says what was).
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
from specula.runtime.bench.constants import BENCH_OFFSET, EVAL_SUITES  # shared by every bench


@dataclass(frozen=True)
class BenchConfig:
    model: str = "target"
    drafters: tuple[dict, ...] = ({"kind": "ngram"},)
    suites: tuple[str, ...] = EVAL_SUITES
    n_per_suite: int = 6
    gammas: tuple[int, ...] = (5,)
    max_tokens: int = 64
    temperature: float = 0.0
    hf_baselines: bool = True
    out: str = "reports/bench-spec"
    seed: int = 0
    device: str = "cpu"  # the target's (and by default the drafters') device: cpu, cuda or cuda:N
    prompts: str = ""  # the user's prompts file ('' = none); its prompts run besides ``suites``
    image_root: str = ""  # where the prompts file's relative image paths start ('' = the file's folder)
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
    """How a drafter config is named in reports: its ``label`` if given, else its kind (+ "/tree" for trees,
    + "+adaptive" with ``"adaptive": true``: the engine chooses each step's draft length, runtime/engine/adaptive.py;
    + "+after<N>" with ``"begin_after": N`` > 1: a request's drafter begins once it has N tokens)."""
    if "label" in config:
        return str(config["label"])
    after = int(config.get("begin_after") or 0)
    return (config["kind"] + ("/tree" if config.get("structure") == "tree" else "")
            + ("+adaptive" if config.get("adaptive") else "") + (f"+after{after}" if after > 1 else ""))


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


def load(model: str, device: str = "cpu", hf: bool = True):
    """(path, processor, our target, the stock HF model) for ``model`` (a zoo name or a local directory), both
    models on ``device``; without ``hf`` the HF model is None (not loaded)."""
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    path = resolve(model)
    target = load_target(str(path), device=device)
    if not hf:
        return path, load_processor(path), target, None
    # the checkpoint's own HF class (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration), as
    # load_target picked it from config.json's model_type
    hf_model = type(target).hf_class.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    return path, load_processor(path), target, hf_model


def all_prompts(cfg: BenchConfig, processor, user_prompts=None, log=print) -> list[tuple]:
    """``[(suite, prompt_id, EncodedPrompt)]``: the world suites' and the user's (``user_prompts``, or
    ``cfg.prompts`` read as a prompts file; the first ``n_per_suite`` of each label), ids unique."""
    from specula.runtime.bench import prompt_file

    if user_prompts is None and cfg.prompts:
        if prompt_file.file_kind(cfg.prompts) == "conversations":
            raise ValueError(f"{cfg.prompts} is a conversation file: read it with specula.cli.bench.read_user_prompts "
                             "and pass user_prompts (runtime/ does not import the training data reader)")
        user_prompts = prompt_file.read_prompts(cfg.prompts, cfg.image_root or None)
    prompts = encoded_prompts(processor, cfg.suites, cfg.n_per_suite, cfg.seed)
    chosen = prompt_file.first_per_suite(user_prompts or [], cfg.n_per_suite)
    if len(chosen) < len(user_prompts or []):
        log(f"[bench spec] {len(chosen)} of the file's {len(user_prompts)} prompts: the first {cfg.n_per_suite} of "
            "each suite label (--n)")
    prompts += prompt_file.encode_user_prompts(processor, chosen)
    if not prompts:
        raise ValueError("bench spec: no prompts (give --suite, --prompts, or --n of at least 1)")
    ids = [pid for _, pid, _ in prompts]
    if clash := sorted({x for x in ids if ids.count(x) > 1}):
        raise ValueError(f"bench spec: prompt id(s) {clash} appear more than once (a prompts file's ids must differ "
                         "from each other and from the world prompts' <suite>-<i>)")
    return prompts


def _n_images(prompt) -> int:
    """Images in an EncodedPrompt: Qwen2.5-VL's grid rows, else LLaVA's pixel batch."""
    if prompt.image_grid_thw is not None:
        return int(prompt.image_grid_thw.shape[0])  # [N_img, 3]
    return 0 if prompt.pixel_values is None else int(prompt.pixel_values.shape[0])  # [N_img, 3, S, S]


def run(cfg: BenchConfig, log=print, loaded=None, user_prompts=None) -> dict:
    """Measure ``cfg``; ``loaded`` is ``load(cfg.model)`` when the caller already holds the models;
    ``user_prompts``: ``UserPrompt``s (runtime/bench/prompt_file.py) run besides the world suites."""
    labels = [config_label(d) for d in cfg.drafters]
    clash = sorted({x for x in labels if labels.count(x) > 1})
    if clash:  # their rows would overwrite each other in every table
        raise ValueError(f"bench spec: drafter configs {clash} appear more than once under the same name; give each a "
                         f"\"label\" (e.g. {{\"kind\": \"text_lm\", \"lean\": false, \"label\": \"text_lm-stock\"}})")
    path, processor, target, hf_model = (loaded if loaded is not None else
                                         load(cfg.model, cfg.device, hf=cfg.hf_baselines))
    if cfg.hf_baselines and hf_model is None:
        raise ValueError("bench spec: hf_baselines needs the stock HF model (load(..., hf=True))")
    prompts = all_prompts(cfg, processor, user_prompts, log)
    suites = list(dict.fromkeys([*cfg.suites, *(s for s, _, _ in prompts)]))
    tok = processor.tokenizer
    drafters = [(d, make_drafter(d, target, tok)) for d in cfg.drafters]
    eos = eos_ids(tok, target)
    engines = {"plain": SpecEngine(target, None, eos_token_ids=eos)}
    for d, drafter in drafters:
        for g in cfg.gammas:
            engines[f"{config_label(d)}@{g}"] = SpecEngine(target, drafter, gamma=g, eos_token_ids=eos,
                                                           adaptive=bool(d.get("adaptive")),
                                                           begin_after=int(d.get("begin_after") or 0))
    assistant, assisted_reason = _hf_assistant([x for _, x in drafters])
    params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed, max_tokens=cfg.max_tokens)
    hf_kw = dict(max_new_tokens=cfg.max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)

    times: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # config -> suite -> s
    tokens_out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    metrics: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    exact: dict[str, list[bool]] = defaultdict(list)
    reference: dict[str, list[int]] = {}
    rows: dict[str, dict] = {}  # prompt id -> its row in the report

    # warm-up: one request through every configuration (first calls allocate and pick kernels)
    _, wid, warm = prompts[0]
    for name, eng in engines.items():
        eng.generate([warm.request(f"warm-{name}", params)])
    with torch.no_grad():
        for suite, pid, prompt in tqdm(prompts, desc="bench spec", unit="prompt", mininterval=2.0):
            ids = prompt.input_ids  # [L]
            row = rows[pid] = {"id": pid, "suite": suite, "prompt_tokens": int(ids.numel()),
                               "images": _n_images(prompt), "exact": {}}
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
                    row["plain_tokens"] = len(r.tokens)
                else:
                    exact[name].append(r.tokens == reference[pid])
                    row["exact"][name] = r.tokens == reference[pid]
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
    loaded_models = {"target": type(target).__name__,
                     "hf_baseline": type(hf_model).__name__ if cfg.hf_baselines else None}
    result = _summarize(cfg, path, suites, times, tokens_out, metrics, exact, assisted_reason)
    return {**result, "loaded": loaded_models, "prompts": list(rows.values())}


def _summarize(cfg, path, suites, times, tokens_out, metrics, exact, assisted_reason) -> dict:
    result = {"config": asdict(cfg), "model": str(path), "suites": suites, "machine": {
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
            "blocks": allm.blocks if allm else None,
            "greedy_exact": (all(exact[name]) if exact[name] else None) if cfg.temperature == 0 else None,
        }
    return result


def render_markdown(r: dict) -> str:
    suites = list(r.get("suites", r["config"]["suites"]))
    lines = ["# Specula bench: speculative vs plain decoding", "",
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
    lines += _draft_cost(r)
    if r.get("hf_assisted_note"):
        lines += ["", f"HF assisted generation: {r['hf_assisted_note']}"]
    if r.get("prompts"):
        lines += ["", "## prompts", "", "| id | suite | prompt tokens | images | plain tokens | greedy output == plain |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]
        for p in r["prompts"]:
            same = all(p["exact"].values()) if p["exact"] and r["config"]["temperature"] == 0 else "-"
            lines.append(f"| {p['id']} | {p['suite']} | {p['prompt_tokens']} | {p['images']} | "
                         f"{p.get('plain_tokens', '-')} | {same} |")
    return "\n".join(lines) + "\n"


def _draft_cost(r: dict) -> list[str]:
    """The draft-cost table: each configuration's drafting time per verification block against T_decode, plain
    decoding's time per step in the same run: the drafting of blocks alone, and with the drafter's prefill of each
    prompt spread over the blocks (that prefill per request, and captions, apart)."""
    plain = r["configs"].get("plain", {})
    split, blocks = plain.get("time_split_s") or {}, plain.get("blocks")
    if not blocks or "verify" not in split:
        return []
    t_decode = split["verify"] / blocks  # s per plain decode step
    lines = ["", "## draft cost per block", "",
             f"T_decode = {t_decode * 1e3:.2f} ms (plain decoding's target time per step, this run). Draft: the "
             "drafter's drafting of blocks / verification blocks; with prefill: its prefill of each prompt "
             "included (a short answer has one or two blocks to spread it over); prefill and caption: per request.",
             "",
             "| config | blocks | draft ms / block | draft / T_decode | with prefill / T_decode | prefill ms / request "
             "| caption ms / request |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    n_requests = len(r.get("prompts") or []) or None
    for name, c in r["configs"].items():
        ts, b = c.get("time_split_s") or {}, c.get("blocks")
        if name == "plain" or not b or "draft" not in ts:
            continue
        per, begin = ts["draft"] / b, ts.get("draft_begin", 0.0)
        pre = f"{begin / n_requests * 1e3:.1f}" if n_requests else "-"
        cap = f"{ts['caption'] / n_requests * 1e3:.1f}" if "caption" in ts and n_requests else "-"
        lines.append(f"| {name} | {b} | {per * 1e3:.2f} | {per / t_decode:.2f} | {(per + begin / b) / t_decode:.2f} "
                     f"| {pre} | {cap} |")
    return lines


def write_report(r: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_spec.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "bench_spec.md").write_text(render_markdown(r))
    suites = list(r.get("suites", r["config"]["suites"]))
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


def drafter_config(ref: str, model: str) -> dict:
    """A ``--drafter`` value as a drafter config: a JSON object as it is; a trained drafter's directory as
    ``specula serve`` reads it (runtime/config_front_door.py), its record checked against ``model``'s weights
    (runtime/config_records.py: a mismatch names both fingerprints); anything else a kind."""
    if ref.strip().startswith("{"):
        return json.loads(ref)
    if not Path(ref).is_dir():
        return {"kind": ref}
    from specula.runtime.config import DrafterConfig
    from specula.runtime.config_front_door import drafter_from_ref
    from specula.runtime.config_records import record_mismatches

    spec = drafter_from_ref(ref)
    if problems := record_mismatches(model, DrafterConfig(**spec)):
        raise ValueError("; ".join(problems))
    return {"kind": spec["kind"], **spec["options"]}


def main(args, user_prompts=None) -> int:
    """``specula bench spec``; ``user_prompts``: the ``--prompts`` file as ``UserPrompt``s (the CLI reads it)."""
    drafters = tuple(drafter_config(d, args.model) for d in (args.drafter or ["ngram"]))
    prompts = getattr(args, "prompts", None) or ""
    suites = tuple(args.suite) if args.suite else (() if prompts else BenchConfig.suites)  # --prompts alone: the file
    cfg = BenchConfig(model=args.model, drafters=drafters, suites=suites,
                      n_per_suite=args.n, gammas=tuple(args.gamma or [5]), max_tokens=args.max_tokens,
                      temperature=args.temperature, hf_baselines=not args.no_hf, out=args.out,
                      device=getattr(args, "device", "cpu"), prompts=str(prompts),
                      image_root=str(getattr(args, "image_root", None) or ""))
    r = run(cfg, user_prompts=user_prompts)
    out = write_report(r, cfg.out)
    print(render_markdown(r))
    print(f"wrote {out}")
    return 0
