"""``specula bench report``: every available drafter on every evaluation suite, side by side in one run, written to
``reports/<date>-<machine>/`` as ``report.json``, ``report.md`` and PNG plots.

Sections (``runtime/bench/report/sections.py``; each records its reason instead of failing the report):

  main          tau and speedup per drafter x suite, greedy (the shape of the papers' main tables), alpha_n, time
                split; greedy outputs checked against plain decoding token for token
  temperature   temperature 0 and 1 (at 1 the speedup divides plain *sampling*'s wall time)
  gamma         the gamma sweep
  multi_image   1-5 images per prompt (the world's multi-image sets): tau per drafter
  concurrency   1, 2, 4, 8 streams through one batched SpecEngine: tokens/s, plain vs the best drafter
  hf            plain HF ``generate`` and HF assisted generation (``bench spec``'s loop)
  target        T_decode and T_verify(gamma) / T_decode (``bench target``)
  wire          bytes on the wire per codec (``runtime/bench/wire.py``)
  overlap       the distributed runtime's overlap efficiency (``bench distributed``, when present)
  served        real Ray Serve (``specula serve``) with the default config and with gamma 0, driven over HTTP by the
                openai client at 1 and 8 streams, beside in-process decoding (``bench served``)
  reliability   only with ``--reliability`` (off by default, in both modes: it takes the suite's own time and
                starts servers): the reliability and security suite run by pytest in a child process, each test's
                figure ("1000/1000 malformed requests rejected, ...") and pass / fail (``report/reliability.py``)

then one "reproduced / not reproduced / not measurable yet" line per seed paper's claim (``report/claims.py``),
computed from the numbers above. ``--quick`` measures fewer prompts and points (<= 10 minutes on 2 cores with the
shipped target); the full mode takes longer.

    specula bench report --quick
    specula bench report --model /tmp/tiny --drafters ngram '{"kind": "random", "peaked": 2.0}' --out /tmp/r
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specula.runtime.bench.report import claims, sections
from specula.runtime.bench.report.args import SECTION_NAMES, add_arguments
from specula.runtime.bench.report.drafters import discover
from specula.runtime.bench.report.machine import machine_facts, machine_slug
from specula.runtime.bench.report.reliability import DEFAULT_TESTS as RELIABILITY_TESTS
from specula.runtime.bench.report.render import render_markdown, write_plots
from specula.runtime.bench.constants import EVAL_SUITES as ALL_SUITES

SECTIONS = {  # in run order: main first (later sections reuse its prompts, outputs and best drafter)
    "main": sections.main_table, "temperature": sections.temperature, "gamma": sections.gamma_sweep,
    "multi_image": sections.multi_image, "concurrency": sections.concurrency, "hf": sections.hf_comparison,
    "target": sections.target_costs, "wire": sections.wire, "overlap": sections.overlap,
    "served": sections.served,
}
assert tuple(SECTIONS) == SECTION_NAMES


@dataclass(frozen=True)
class ReportConfig:
    """What the report measures. The defaults are the full mode; ``QUICK`` overrides them for ``--quick``."""

    model: str = "target"  # zoo entry or local checkpoint directory
    drafters: tuple[dict, ...] | None = None  # None: every registered kind, chain + tree where supported
    suites: tuple[str, ...] = ALL_SUITES
    n_per_suite: int = 6  # main section prompts per suite
    max_tokens: int = 64
    gamma: int = 5  # draft length of every section but the sweep
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    gamma_suites: tuple[str, ...] = ("caption", "reasoning", "chart", "ocr")
    gamma_n: int = 3
    gamma_all_drafters: bool = True  # False: sweep only the best drafter
    every_variant: bool = True  # False: after the main section, one variant (chain or tree) per kind, the faster
    temperature_suites: tuple[str, ...] = ALL_SUITES
    temperature_n: int = 3
    image_counts: tuple[int, ...] = (1, 2, 3, 4, 5)
    images_n: int = 4
    streams: tuple[int, ...] = (1, 2, 4, 8)
    hf_suites: tuple[str, ...] = ALL_SUITES
    hf_n: int = 2
    target_max_gamma: int = 8
    target_repeats: int = 20
    overlap_suites: tuple[str, ...] = ("caption", "vqa", "reasoning", "text")
    overlap_n: int = 2
    served_suites: tuple[str, ...] = ALL_SUITES
    served_n: int = 4
    served_streams: tuple[int, ...] = (1, 8)
    codecs: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "fp16+lz4", "fp16+zstd", "int8+lz4", "int8+zstd")
    wire_repeats: int = 5
    skip: tuple[str, ...] = ()  # section names not to run
    reliability: bool = False  # run the reliability suite (pytest, child process) and collect its figures
    reliability_tests: tuple[str, ...] = RELIABILITY_TESTS  # pytest paths / node ids, relative to the checkout
    reliability_timeout_s: float = 3600.0  # then pytest and its children are killed and the section is "failed"
    seed: int = 0
    quick: bool = False


QUICK = dict(n_per_suite=1, max_tokens=40, gammas=(2, 4, 6), gamma_suites=("caption", "reasoning"), gamma_n=1,
             gamma_all_drafters=False, every_variant=False, temperature_suites=("caption", "reasoning", "chart"),
             temperature_n=1, image_counts=(1, 3, 5), images_n=1, hf_suites=("caption", "reasoning"), hf_n=1,
             target_max_gamma=6, target_repeats=5, wire_repeats=2, overlap_suites=("caption", "text"), overlap_n=1,
             served_suites=("caption", "vqa", "text"), served_n=1, served_streams=(1,), quick=True)


def _check(cfg: ReportConfig) -> None:
    from specula.world.suites import SUITES

    for name in ("suites", "gamma_suites", "temperature_suites", "hf_suites", "overlap_suites", "served_suites"):
        bad = [s for s in getattr(cfg, name) if s not in SUITES]
        if bad:
            raise ValueError(f"{name}: unknown suite(s) {bad}; known: {', '.join(SUITES)}")
    bad = [s for s in cfg.skip if s not in SECTIONS]
    if bad:
        raise ValueError(f"skip: unknown section(s) {bad}; known: {', '.join(SECTIONS)}")
    for name in ("n_per_suite", "max_tokens", "gamma", "gamma_n", "temperature_n", "images_n", "hf_n",
                 "overlap_n", "served_n", "target_max_gamma", "target_repeats", "wire_repeats"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not all(1 <= k <= 5 for k in cfg.image_counts):
        raise ValueError(f"image_counts must be in 1..5 (the world's sets), got {cfg.image_counts}")
    if any(g < 1 for g in cfg.gammas) or any(s < 1 for s in (*cfg.streams, *cfg.served_streams)):
        raise ValueError("gammas, streams and served_streams must be >= 1")
    if cfg.reliability_timeout_s <= 0:
        raise ValueError(f"reliability_timeout_s must be > 0, got {cfg.reliability_timeout_s}")


def _guarded(name: str, fn, ctx, log) -> dict:
    t0 = time.perf_counter()
    try:
        out = fn(ctx)
    except Exception as e:  # one section failing must not take the report down: record why and go on
        out = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=6).splitlines()[-8:]}
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    log(f"[bench report] {name}: {out['status']} in {out['wall_s']:.1f} s"
        + (f" ({out['reason']})" if out["status"] != "ok" else ""))
    return out


def ideal_speedups(r: dict) -> dict:
    """Per main-section drafter: the speedup a free drafter would give, tau / (T_verify(nodes) / T_decode), and the
    measured share of it (the overlap efficiency of docs/design.md, "Notation"). Nodes per block = draft tokens /
    blocks, nearest measured gamma."""
    main, tgt = r["sections"].get("main", {}), r["sections"].get("target", {})
    if main.get("status") != "ok" or tgt.get("status") != "ok":
        return {}
    ratio = {v["gamma"]: v["ratio"] for v in tgt["verify"]}
    out = {}
    for name, c in main["configs"].items():
        a = c["all"]
        if name == "plain" or not a["blocks"] or a["tau"] is None:
            continue
        nodes = round(a["draft_tokens"] / a["blocks"])
        if nodes < 1 or nodes > max(ratio):
            continue
        ideal = a["tau"] / ratio[min(ratio, key=lambda g: abs(g - nodes))]
        out[name] = {"nodes_per_block": nodes, "ideal_speedup": round(ideal, 3),
                     "efficiency": round(a["speedup_vs_plain"] / ideal, 3) if a["speedup_vs_plain"] else None}
    return out


def run(cfg: ReportConfig, log=print, out: str | Path | None = None) -> dict:
    """Measure every section; ``out`` is the report folder sections may leave files in (the reliability suite's
    figures, junit XML and log), by default ``default_out`` of this run."""
    from specula.runtime.bench.spec import load

    _check(cfg)
    t_start = time.perf_counter()
    facts = machine_facts()
    path, processor, target, hf_model = load(cfg.model)
    found = discover(list(cfg.drafters) if cfg.drafters is not None else None, target, processor.tokenizer)
    log(f"[bench report] drafters: {', '.join(a.label for a in found.available) or 'none'}; missing: "
        f"{', '.join(m['label'] for m in found.missing) or 'none'}")
    result = {"date": datetime.date.today().isoformat(), "slug": machine_slug(facts), "machine": facts,
              "model": str(path), "config": asdict(cfg), "drafters": found.to_json(), "sections": {}}
    ctx = sections.Ctx(cfg, path, processor, target, hf_model, found, [processor.tokenizer.eos_token_id],
                       workdir=Path(out) if out is not None else default_out(result))
    for name, fn in SECTIONS.items():
        if name in cfg.skip:
            result["sections"][name] = sections.not_measured("skipped (--skip)")
            continue
        result["sections"][name] = _guarded(name, fn, ctx, log)
    if cfg.reliability:  # opt-in, so not in SECTIONS (--skip); a report without it says how to get it
        result["sections"]["reliability"] = _guarded("reliability", sections.reliability, ctx, log)
    result["ideal"] = ideal_speedups(result)
    result["claims"] = claims.evaluate(result)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def default_out(r: dict) -> Path:
    return Path("reports") / f"{r['date']}-{r['slug']}"


def write_report(r: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    r["plots"], r["plot_errors"] = write_plots(r, out)
    (out / "report.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(r))
    return out


def _drafter_arg(s: str) -> dict:
    s = s.strip()
    if s.startswith("{"):
        d = json.loads(s)
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError(f"--drafters: a JSON config needs a 'kind', got {s[:80]!r}")
        return d
    return {"kind": s}


def config_from_args(args) -> ReportConfig:
    kw = dict(QUICK) if args.quick else {}
    kw["model"] = args.model
    if args.drafters:
        try:
            kw["drafters"] = tuple(_drafter_arg(d) for d in args.drafters)
        except json.JSONDecodeError as e:
            raise ValueError(f"--drafters: not valid JSON: {e}") from None
    for flag, key in (("suite", "suites"), ("skip", "skip")):
        if getattr(args, flag):
            kw[key] = tuple(getattr(args, flag))
    for key in ("n_per_suite", "max_tokens", "gamma", "seed", "reliability_timeout_s"):
        if getattr(args, key, None) is not None:
            kw[key] = getattr(args, key)
    if getattr(args, "reliability", False):
        kw["reliability"] = True
    return dataclasses.replace(ReportConfig(), **kw)


def main(args) -> int:
    cfg = config_from_args(args)
    r = run(cfg, out=args.out)
    out = write_report(r, args.out or default_out(r))
    print(f"wrote {out / 'report.md'} ({r['wall_s']:.0f} s); claims:")
    for c in r["claims"]:
        print(f"  {c['paper']}: {c['verdict']} ({c['evidence']})")
    failed = [k for k, s in r["sections"].items() if s["status"] == "failed"]
    if failed:
        print(f"sections that failed (see report.json): {', '.join(failed)}")
    return 0


if __name__ == "__main__":  # python -m specula.runtime.bench.report.run --quick
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    raise SystemExit(main(a))
