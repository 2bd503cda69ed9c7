"""``report.md`` and the PNG plots, drawn from the report's JSON only (so a saved report can be re-rendered)."""

from __future__ import annotations

from pathlib import Path

from specula.runtime.bench.plots import bar_chart, line_chart, stacked_bar_chart
from specula.runtime.bench.ceilings import ceilings_md
from specula.runtime.bench.prefill_matmuls import describe
from specula.runtime.bench.served import (MANY_STREAMS_NOTE, longest_answers, served_per_suite_md, served_split_md,
                                         suite_speedups)

TITLES = {
    "main": "tau and speedup per drafter x suite (greedy), alpha_n, time split",
    "gamma": "gamma sweep",
    "temperature": "temperature 0 and 1",
    "multi_image": "multi-image scaling (1-5 images per prompt)",
    "concurrency": "throughput vs concurrency",
    "hf": "comparison with HF generate and HF assisted generation",
    "target": "target costs: T_verify(gamma) / T_decode",
    "wire": "wire bytes per codec",
    "overlap": "overlap efficiency of the distributed runtime",
    "served": "served (Ray Serve, openai client) vs in process",
}


def _f(x, nd: int = 2, suffix: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{nd}f}{suffix}"
    return f"{x}{suffix}"


def _status(sec: dict | None) -> str | None:
    """None when the section has numbers, else the line that says why not."""
    if sec is None:
        return "*not run*"
    if sec.get("status") == "ok":
        return None
    return f"*{sec.get('status', 'failed').replace('_', ' ')}*: {sec.get('reason', 'no reason recorded')}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _machine(r: dict) -> list[str]:
    m = r["machine"]
    keys = ["cpu_model", "cpu_count", "cpus_usable", "torch_threads", "omp_num_threads", "load_average", "platform",
            "python", "torch", "transformers", "ray", "numpy", "cuda", "gpu"]
    return _table(["fact", "value"], [[k, _f(m.get(k))] for k in keys if k in m])


def _main(sec: dict, ideal: dict) -> list[str]:
    suites = sec["suites"]
    cols = ["config"] + suites + ["visual", "all", "greedy == plain"]
    cols += ["ideal (tau / T_verify ratio)"] if ideal else []
    rows = []
    for name, c in sec["configs"].items():
        cell = lambda s: f"{_f(s['tau'])} / {_f(s['speedup_vs_plain'])}x" if s else "-"  # noqa: E731
        exact = c["all"].get("exact", None if name != "plain" else "ref")
        row = [name] + [cell(c["groups"][s]) for s in suites] + [cell(c.get("visual")), cell(c["all"]), _f(exact)]
        if ideal:
            row.append(_f(ideal.get(name, {}).get("ideal_speedup"), 2, "x"))
        rows.append(row)
    return [f"Cells: tau / speedup vs plain decoding (same prompts, same run). Greedy, gamma {sec['gamma']}, "
            f"{sec['n_per_suite']} prompt(s) per suite, max_tokens {sec['max_tokens']}. Best: `{sec['best']}`.", "",
            *_table(cols, rows)]


def render_markdown(r: dict) -> str:
    S = r["sections"]
    cfg = r["config"]
    lines = [f"# Specula benchmark report: {r['date']}, {r['slug']}", "",
             f"Model `{r['model']}`; mode **{'quick' if cfg['quick'] else 'full'}**; wall time {r['wall_s']:.0f} s. "
             "Every figure is a ratio measured side by side in this one run (configurations round robin per "
             "prompt); absolute times on a shared machine are noisy.", "", "## Machine", "", *_machine(r), "",
             "## Drafters", ""]
    av = r["drafters"]["available"]
    lines += _table(["drafter", "kind", "structure", "needs"],
                    [[a["label"], a["kind"], a["structure"], ", ".join(a["needs"]) or "-"] for a in av]) if av \
        else ["No drafter could be built."]
    if r["drafters"]["missing"]:
        lines += ["", "Not measured:", ""] + [f"- `{m['label']}`: {m['reason']}" for m in r["drafters"]["missing"]]
    lines += ["", "## Seed papers' claims", ""]
    lines += [f"- **{c['paper']}** ({c['claim']}): **{c['verdict']}**. {c['evidence']}. Rule: {c['rule']}."
              for c in r["claims"]]
    for i, key in enumerate(TITLES, 1):
        lines += ["", f"## {i}. {TITLES[key]}", ""]
        sec = S.get(key)
        why = _status(sec)
        if why:
            lines.append(why)
            continue
        lines += SECTION_MD[key](sec, r)
        if key == "main":
            lines += ["", "### alpha_n (acceptance rate of draft position n)", ""]
            lines += [f"- {n}: " + ", ".join(_f(a) for a in c["all"]["alpha"]) for n, c in sec["configs"].items()
                      if c["all"]["alpha"]]
            lines += ["", "### time split (seconds, all prompts)", ""]
            t_decode = t_decode_ms(sec)
            lines += ["Draft: the drafter's time, its prefill of each prompt included; draft ms / block: the drafting "
                      "of blocks alone; / T_decode: over plain decoding's target time per step in this run"
                      + (f" ({t_decode:.2f} ms)" if t_decode else "") + "; prefill ms / request: the drafter's "
                      "prefill of each prompt.", ""]
            lines += _table(["config", "draft", "verify", "other", "draft ms / block", "draft / T_decode",
                             "prefill ms / request"],
                            [[n, *(_f(c["all"]["time_split_s"][k], 3) for k in ("draft", "verify", "other")),
                              _f(c["all"]["draft_ms_per_block"], 3),
                              _f(c["all"]["draft_ms_per_block"] / t_decode if t_decode and n != "plain" else None),
                              _f(c["all"].get("draft_begin_ms_per_request"), 3)]
                             for n, c in sec["configs"].items()])
    lines += ["", f"## {len(TITLES) + 1}. {RELIABILITY_TITLE}", "", *_reliability_md(S.get("reliability"))]
    if r.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in r["plots"]]
    if r.get("plot_errors"):
        lines += ["", "Plots that could not be drawn:", ""] + [f"- {e}" for e in r["plot_errors"]]
    return "\n".join(lines) + "\n"


def t_decode_ms(sec: dict) -> float | None:
    """Plain decoding's target time per step in the main section's run (ms): its verify time over its steps."""
    plain = (sec.get("configs") or {}).get("plain", {}).get("all") or {}
    steps, verify = plain.get("blocks"), (plain.get("time_split_s") or {}).get("verify")
    return 1000 * verify / steps if steps and verify else None


def _gamma_md(sec, r):
    gs = [str(g) for g in sec["gammas"]]
    rows = [[n] + [f"{_f(t[g]['tau'])} / {_f(t[g]['speedup_vs_plain'])}x" for g in gs]
            for n, t in sec["drafters"].items()]
    return [f"Cells: tau / speedup vs plain; suites {', '.join(sec['suites'])}, {sec['n_per_suite']} prompt(s) "
            "each.", "",
            *_table(["drafter"] + [f"gamma {g}" for g in gs], rows)]


def _temperature_md(sec, r):
    t0, t1 = sec["by_temperature"]["0"] or {}, sec["by_temperature"]["1"]
    rows = [[n, _f((t0.get(n) or {}).get("tau")), _f((t0.get(n) or {}).get("speedup_vs_plain"), 2, "x"),
             _f(c["tau"]), _f(c["speedup_vs_plain"], 2, "x")] for n, c in t1.items()]
    return [f"Suites {', '.join(sec['suites'])}; {sec['note']}.", "",
            *_table(["config", "tau T=0", "speedup T=0", "tau T=1", "speedup T=1 (vs plain sampling)"], rows)]


def _multi_md(sec, r):
    gs = [f"k={k}" for k in sec["image_counts"]]
    rows = [[n] + [f"{_f(c['groups'][g]['tau'])} / {_f(c['groups'][g]['speedup_vs_plain'])}x" for g in gs]
            for n, c in sec["configs"].items()]
    return [f"Cells: tau / speedup vs plain; {sec['n_per_count']} prompt(s) per image count; prompt tokens: "
            + ", ".join(f"{g}: {sec['prompt_tokens'][g]}" for g in gs) + ".", "",
            *_table(["config"] + [f"{k} image(s)" for k in sec["image_counts"]], rows)]


def _concurrency_md(sec, r):
    ls = [str(s) for s in sec["streams"]]
    rows = [[n] + [f"{_f(c[l]['tokens_per_s'], 1)} ({c[l]['equal_to_single_request'] or '-'})" for l in ls]
            for n, c in sec["configs"].items()]
    return [f"Cells: tokens/s (outputs equal to the single-request run). {sec['note']}.", "",
            *_table(["config"] + [f"{l} stream(s)" for l in ls], rows)]


def _hf_md(sec, r):
    rows = [[n, _f(c["tokens_per_s"], 1), _f(c["speedup_vs_plain"], 2, "x"), _f(c["speedup_vs_hf_generate"], 2, "x"),
             _f(c["speedup_vs_hf_assisted"], 2, "x"), _f(c["tau"]), _f(c["greedy_exact"])]
            for n, c in sec["configs"].items()]
    return [f"Suites {', '.join(sec['suites'])}, {sec['n_per_suite']} prompt(s) each, greedy, gamma {sec['gamma']} "
            f"(`bench spec`'s loop). HF assisted generation: {sec['hf_assisted']}.{_hf_kernels(sec)}", "",
            *_table(["config", "tokens/s", "vs plain (ours)", "vs HF generate", "vs HF assisted", "tau",
                     "greedy == plain"], rows)]


def _hf_kernels(sec) -> str:
    if not sec.get("packed_linears"):
        return ""
    return (" HF's rows run the stock model as transformers loads it (CPU linears through MKL's sgemm); ours run "
            f"the same weights with {sec['packed_linears']} linears packed for oneDNN (`model.packed_linears`), "
            "which alone makes plain decoding faster here.")


def _target_md(sec, r):
    head = [f"T_decode {_f(sec['decode_ms'], 3)} ms, prefill {_f(sec['prefill_ms'], 2)} ms, vision encode "
            f"{_f(sec['encode_ms'], 2)} ms ({sec['repeats']} repeats, medians); parameters "
            f"{sec['params'].get('total', 0):,}.", ""]
    table = _table(["gamma", "T_verify ms", "T_verify / T_decode"],
                   [[v["gamma"], _f(v["ms"], 3), _f(v["ratio"], 3)] for v in sec["verify"]])
    return head + table + (["", text] if (text := describe(sec.get("prefill_matmuls"))) else [])


def _wire_md(sec, r):
    rows = []
    for codec, by in sec["codecs"].items():
        for shape, v in by.items():
            rows.append([codec, shape, v["wire_bytes"], _f(v["ratio"], 3), _f(v["encode_ms"], 3),
                         _f(v["decode_ms"], 3), f"{v['max_rel_err']:.1e}"])
    return _table(["codec", "tensor", "wire bytes", "/ raw", "encode ms", "decode ms", "max rel err"], rows)


def _overlap_md(sec, r):
    o = sec["overlap"]
    rows = [[n, _f(c.get("tau")), _f(c.get("speedup_vs_plain"), 2, "x"),
             _f(c.get("decode_speedup_vs_plain"), 2, "x"), _f(c.get("ideal_speedup"), 2, "x"),
             _f(c.get("overlap_efficiency"), 3), _f(c.get("critical_draft_vs_t_decode"), 3),
             _f(c.get("transfer_share_of_block_step"), 3), _f(c.get("greedy_exact"))] for n, c in sec["configs"].items()]
    return [f"`bench distributed` with drafter `{sec['drafter']['kind']}`, gamma {sec['gamma']}, suites "
            f"{', '.join(sec['suites'])} ({sec['n_per_suite']} prompt(s) each); verifier in this process, drafter in a "
            f"child process over loopback gRPC. Overlap efficiency = speedup / (tau x T_decode / T_verify(gamma)): "
            f"pipelined {_f(o.get('efficiency'), 3)}; pipelined vs sequential {_f(o.get('pipelined_vs_sequential'))}x "
            f"end to end, {_f(o.get('decode_pipelined_vs_sequential'))}x in the decode phase (after each request's "
            f"first token); with predraft (blocks drafted for rejections) vs pipelined "
            f"{_f(o.get('predraft_vs_pipelined'))}x end to end, {_f(o.get('decode_predraft_vs_pipelined'))}x decode; "
            f"with offers (predraft, blocks sent unasked) vs sequential {_f(o.get('offers_vs_sequential'))}x end to "
            f"end, {_f(o.get('decode_offers_vs_sequential'))}x decode.",
            "", *_table(["config", "tau", "speedup vs plain", "decode-phase speedup", "ideal", "efficiency",
                         "drafter on the critical path / T_decode", "transfer share", "greedy == plain"], rows)]


RELIABILITY_TITLE = "reliability and security suite: each test's figure"


def _phases(ms: dict) -> str:
    """prefill / draft / verify ms per token; draft is the drafter's whole time, its prefill of each prompt
    (``draft_begin``) included."""
    ms = {**ms, "draft": ms.get("draft", 0.0) + ms.get("draft_begin", 0.0)} if "draft" in ms else ms
    return " / ".join(f"{p} {ms[p]:.2f}" for p in ("prefill", "draft", "verify") if p in ms)


def _served_md(sec, r):
    rows = [[*k.split("/"), _f(v["tokens_per_s"], 1), _f(v["speedup_vs_plain"], 3), _f(v["vs_in_process_plain"], 3),
             _f(v["tau"], 2), _f(v["exact"]), _phases(v["ms_per_token"])] for k, v in sec["rows"].items()]
    suites = sec["suites"]
    per_suite = [[runtime, name, streams, *(_f(x, 2, "x") for x in ratios)]
                 for runtime, name, streams, ratios in suite_speedups(sec["rows"], suites)]
    route = f" ({sec['text_only']} for text-only requests)" if sec.get("text_only") else ""
    return [f"Default drafter {sec['drafter']['kind']}@{sec['gamma']}{route}, {sec['n_per_suite']} prompts x "
            f"{len(suites)} suites, round robin, each runtime alone on the machine.", "",
            *_table(["runtime", "config", "streams", "tokens/s", "x plain (same runtime)", "x in-process plain",
                     "tau", "greedy == in-process plain", "ms per token: prefill / draft / verify"], rows),
            "", "The default config over plain decoding of the same runtime, per suite (tokens/s of each request's "
                "own wall time):", "", *_table(["runtime", "config", "streams", *suites], per_suite),
            *(["", *split] if (split := served_split_md(sec["rows"])) else []),
            *(["", *per] if (per := served_per_suite_md(sec["rows"], suites)) else []),
            *(["", MANY_STREAMS_NOTE] if any(int(s) > 1 for s in sec.get("concurrency") or ()) else []),
            *(["", *lines] if (lines := ceilings_md(sec["rows"], longest_answers(sec["rows"]))) else [])]


def _cell(text) -> str:
    """Text that stays in its markdown table cell."""
    return str(text).replace("\n", " ").replace("|", "\\|")


def _reliability_md(sec: dict | None) -> list[str]:
    """Drawn when the suite ran even if it failed (its figures and outcomes stand, with pytest's tail)."""
    if sec is None:
        return ["*not run*: `specula bench report --reliability` runs it."]
    if sec.get("status") == "not_measured" or "results" not in sec:
        return [_status(sec) or "*no results*"]
    c = sec["counts"]
    lines = [f"`{sec['command']}` from the checkout, figures collected from `$SPECULA_FIGURES_OUT` "
             f"(`{sec['files']['figures']}`): {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
             f"{c['skipped']} skipped{' in ' + _f(sec['wall_s'], 0) + ' s' if 'wall_s' in sec else ''}."]
    if sec["status"] != "ok":
        lines += ["", _status(sec)]
    if sec.get("note"):
        lines += ["", sec["note"] + "."]
    lines += ["", "| test | outcome | figure |", "| --- | --- | --- |"]
    for row in sec["results"]:
        name = f"{row['file'].rsplit('.', 1)[-1]}::{row['test']}" if row["file"] else row["test"]
        figure = "<br>".join(_cell(f) for f in row["figures"]) or "-"
        lines.append(f"| `{name}` | {row['outcome'] or 'unknown'} | {figure} |")
    if sec.get("tail"):
        lines += ["", "pytest's last lines:", "", "```", *sec["tail"], "```"]
    return lines


SECTION_MD = {"main": lambda s, r: _main(s, r.get("ideal") or {}), "gamma": _gamma_md,
              "temperature": _temperature_md, "multi_image": _multi_md, "concurrency": _concurrency_md,
              "hf": _hf_md, "target": _target_md, "wire": _wire_md, "overlap": _overlap_md,
              "served": _served_md}


# ---------------------------------------------------------------------------------------------------- plots


def _z(x) -> float:
    return float(x) if x is not None else 0.0


def _plot_main(sec, out):
    suites = sec["suites"]
    spec = {n: c for n, c in sec["configs"].items() if n != "plain"}
    if not spec:
        return []
    bar_chart(out / "tau_per_suite.png", "tau per drafter x suite (greedy)", suites,
              {n: [_z(c["groups"][s]["tau"]) for s in suites] for n, c in spec.items()}, "tau")
    bar_chart(out / "speedup_per_suite.png", "speedup vs plain decoding per suite", suites,
              {n: [_z(c["groups"][s]["speedup_vs_plain"]) for s in suites] for n, c in spec.items()}, "speedup")
    files = ["tau_per_suite.png", "speedup_per_suite.png"]
    depth = max(len(c["all"]["alpha"]) for c in spec.values())
    if depth:
        line_chart(out / "alpha_n.png", "alpha_n: acceptance per draft position", list(range(1, depth + 1)),
                   {n: [_z(a) for a in (c["all"]["alpha"] + [0.0] * depth)[:depth]] for n, c in spec.items()},
                   "alpha", "position n")
        files.append("alpha_n.png")
    names = list(sec["configs"])
    stacked_bar_chart(out / "time_split.png", "time split, all prompts (s)", names,
                      {k: [_z(sec["configs"][n]["all"]["time_split_s"][k]) for n in names]
                       for k in ("draft", "verify", "other")}, "seconds")
    return files + ["time_split.png"]


def _plot_gamma(sec, out):
    gs = sec["gammas"]
    for key, name, label in (("speedup_vs_plain", "gamma_speedup.png", "speedup"), ("tau", "gamma_tau.png", "tau")):
        line_chart(out / name, f"{label} vs gamma", gs,
                   {n: [_z(t[str(g)][key]) for g in gs] for n, t in sec["drafters"].items()}, label, "gamma")
    return ["gamma_speedup.png", "gamma_tau.png"]


def _plot_temperature(sec, out):
    t0, t1 = sec["by_temperature"]["0"] or {}, sec["by_temperature"]["1"]
    names = [n for n in t1 if n != "plain"]
    if not names:
        return []
    bar_chart(out / "temperature.png", "speedup vs plain at temperature 0 and 1", names,
              {"T=0": [_z((t0.get(n) or {}).get("speedup_vs_plain")) for n in names],
               "T=1": [_z(t1[n]["speedup_vs_plain"]) for n in names]}, "speedup")
    return ["temperature.png"]


def _plot_multi(sec, out):
    ks = sec["image_counts"]
    spec = {n: c for n, c in sec["configs"].items() if n != "plain"}
    if not spec:
        return []
    line_chart(out / "multi_image_tau.png", "tau vs images per prompt", ks,
               {n: [_z(c["groups"][f"k={k}"]["tau"]) for k in ks] for n, c in spec.items()}, "tau", "images")
    return ["multi_image_tau.png"]


def _plot_concurrency(sec, out):
    ls = sec["streams"]
    line_chart(out / "concurrency.png", "throughput vs concurrent streams", ls,
               {n: [_z(c[str(l)]["tokens_per_s"]) for l in ls] for n, c in sec["configs"].items()}, "tokens/s",
               "streams")
    return ["concurrency.png"]


def _plot_hf(sec, out):
    names = list(sec["configs"])
    bar_chart(out / "hf_comparison.png", "tokens/s: our engine vs HF generate / assisted", ["tokens/s"],
              {n: [_z(sec["configs"][n]["tokens_per_s"])] for n in names}, "tokens/s")
    return ["hf_comparison.png"]


def _plot_target(sec, out):
    line_chart(out / "verify_ratio.png", "T_verify(gamma) / T_decode", [v["gamma"] for v in sec["verify"]],
               {"T_verify / T_decode": [v["ratio"] for v in sec["verify"]]}, "ratio", "gamma")
    return ["verify_ratio.png"]


def _plot_wire(sec, out):
    codecs = list(sec["codecs"])
    bar_chart(out / "wire_bytes.png", "wire bytes / raw fp32 bytes per codec", codecs,
              {s: [_z(sec["codecs"][c][s]["ratio"]) for c in codecs] for s in sec["shapes"]}, "ratio")
    return ["wire_bytes.png"]


PLOTS = {"main": _plot_main, "gamma": _plot_gamma, "temperature": _plot_temperature, "multi_image": _plot_multi,
         "concurrency": _plot_concurrency, "hf": _plot_hf, "target": _plot_target, "wire": _plot_wire}


def write_plots(r: dict, out: Path) -> tuple[list[str], list[str]]:
    """Draw every plot whose section has numbers: (files written, errors)."""
    files, errors = [], []
    for key, fn in PLOTS.items():
        sec = r["sections"].get(key)
        if not sec or sec.get("status") != "ok":
            continue
        try:
            files += fn(sec, out)
        except Exception as e:  # a plot that cannot be drawn is reported, the rest of the report stands
            errors.append(f"{key}: {type(e).__name__}: {e}")
    return files, errors
