"""``python -m research probe-charts``: where a target's heads look when it answers a chart question.

Two readings of held-out chart questions, the answer fed in (teacher-forced), at the position that predicts it:

- ``heads``: for bar-value questions ("What is the value of the red bar?"), every decoder layer's and head's
  attention mass on the asked bar's patches, on the number printed above it, on the other image tokens and on text.
  A head that reads the value has to land on the number (zoo/TRAINING.md, "Counting and the odd one out on the suites
  mix; chart referents": in the counting target no layer-1 head gives it more than 0.002, head 3 of layer 3 gives it
  0.16);
- ``targets``: for every chart referent target (training/target/chart_referents.py, all question kinds of the training
  dialogues), the mass its head puts on its positions, mean and minimum per (chart kind, hop), and the mean
  -log of it that ``--chart-referents`` trains (floored at 1e-30, where its gradient is gone);
- ``words``: whether the visual tokens carry the ``--chart-words`` reading words (research/chart_word_probe.py).
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from specula.world import charts
from specula.training.target.batching import Encoder
from specula.training.target.chart_referents import NUMBER_HEAD, NUMBER_LAYER, bar_patches
from research.chart_word_probe import word_readout
from specula.training.target.referents import eager_attention

PARTS = ("asked bar", "its number", "other image", "text")
FLOOR = 1e-30  # referents._log's floor for the exact-log groups


def _attentions(model, e):
    """Per decoder layer [heads, L, L] attention weights of one encoded sample."""
    with torch.no_grad(), eager_attention(model.model.language_model):
        out = model(input_ids=e.input_ids[None].to(model.device),
                    pixel_values=e.pixel_values.to(model.device, model.dtype), output_attentions=True)
    return [a[0].float().cpu() for a in out.attentions]


def head_masses(model, processor, n: int = 30, seed: int = 0) -> dict:
    """Mean mass of every (layer, head) on PARTS at the answers of ``n`` held-out bar-value questions."""
    enc = Encoder(processor, chart_referents=True)
    sums: dict[tuple[int, int], torch.Tensor] = defaultdict(lambda: torch.zeros(len(PARTS)))
    done = 0
    for i in range(50 * n):
        s = charts.make(random.Random(f"probe-charts/{seed}/{i}"), "chart", "qa")
        if s.kind != "chart/bar" or not s.response.isdigit():
            continue
        e = enc.encode(s)
        number = [t for t in e.referents if t.group == "chart" and (t.patch_layer, t.head) == (NUMBER_LAYER, NUMBER_HEAD)]
        if not number:
            continue
        colour = next(c for c in charts.CHART_COLOURS if f" {c} bar" in s.prompt)
        image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
        bar = [image_pos[p] for p in bar_patches(s.patch_words[0], colour, label=False)]
        query, label = number[0].query, list(number[0].patches)
        for layer, att in enumerate(_attentions(model, e)):
            row = att[:, query]  # [heads, L]
            on_bar, on_number, on_image = row[:, bar].sum(-1), row[:, label].sum(-1), row[:, image_pos].sum(-1)
            for h in range(row.shape[0]):
                sums[(layer, h)] += torch.stack([on_bar[h], on_number[h], on_image[h] - on_bar[h] - on_number[h],
                                                 1 - on_image[h]])
        done += 1
        if done == n:
            break
    if not done:
        raise ValueError("no bar-value question with a readable number was drawn")
    return {"n": done, "parts": list(PARTS),
            "by_head": [{"layer": l, "head": h, "mass": [round(float(x), 4) for x in v / done]}
                        for (l, h), v in sorted(sums.items())]}


def target_masses(model, processor, n: int = 40, seed: int = 0) -> dict:
    """Mass of each chart referent target's head on its positions, over ``n`` held-out chart dialogues."""
    enc = Encoder(processor, chart_referents=True)
    got: dict[str, list[float]] = defaultdict(list)
    for i in range(n):
        s = charts.make_dialogue(random.Random(f"probe-charts/d/{seed}/{i}"), "chart", "qa")
        e = enc.encode(s)
        if not e.referents:
            continue
        att = _attentions(model, e)
        kind = s.kind.split("/")[1]
        for t in e.referents:
            hop = "number" if (t.patch_layer, t.head) == (NUMBER_LAYER, NUMBER_HEAD) else "part"
            got[f"{kind} {hop} (layer {t.patch_layer} head {t.head})"].append(
                float(att[t.patch_layer][t.head, t.query, list(t.patches)].sum()))
            if t.words:
                head = t.head if t.word_head is None else t.word_head
                got[f"{kind} word (layer {t.word_layer} head {head})"].append(
                    float(att[t.word_layer][head, t.query, list(t.words)].sum()))
    out = {}
    for name, masses in sorted(got.items()):
        m = torch.tensor(masses)
        out[name] = {"n": len(masses), "mean": round(float(m.mean()), 4), "min": float(m.min()),
                     "neg_log": round(float(-m.clamp_min(FLOOR).log().mean()), 3)}
    return {"dialogues": n, "hops": out}


def _fraction(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(report: dict) -> str:
    h = report["heads"]
    lines = [f"Bar-value answers ({h['n']}): each head's attention mass", "",
             "| layer | head | " + " | ".join(h["parts"]) + " |", "| ---: | ---: |" + " ---: |" * len(h["parts"])]
    lines += [f"| {r['layer']} | {r['head']} | " + " | ".join(f"{x:.3f}" for x in r["mass"]) + " |"
              for r in h["by_head"]]
    t = report["targets"]
    lines += ["", f"Chart referent targets ({t['dialogues']} dialogues): mass on the target", "",
              "| hop | n | mean | min | mean -log |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['n']} | {v['mean']:.4f} | {v['min']:.2e} | {v['neg_log']:.2f} |" for k, v in t["hops"].items()]
    lines += ["", "Chart reading words read from the visual tokens (nearest word code; research/chart_word_probe.py)", "",
              "| reading | n | accuracy |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v['n']} | {_fraction(v['accuracy'])} |" for k, v in report["words"].items()]
    return "\n".join(lines)


def probe_charts_cli(args) -> int:
    from research.probe_output import emit, load_source

    if args.n < 1:
        raise SystemExit("--n must be at least 1")
    model, processor = load_source(args)
    report = {"model": args.checkpoint or args.model,
              "heads": head_masses(model, processor, n=args.n, seed=args.seed),
              "targets": target_masses(model, processor, n=args.n, seed=args.seed),
              "words": word_readout(model, processor, n=2 * args.n, seed=args.seed)}
    emit(report, markdown(report), args.out, "probe_charts", args.json)
    return 0
