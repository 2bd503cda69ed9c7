"""``python -m research probe-sets``: how a target reads image sets, teacher-forced, hop by hop.

The image-set lanes were steered by throwaway probe scripts under ``runs/``, lost with it twice. This is the same
reading, kept: held-out image-set questions (the ``multi_image`` suite's eval split, past the indices the
gates use), each run once through the LM with eager attention and the answer fed in, and per question type

- ``right``: the first answer token's argmax over the type's candidate words (colours for "which", the set's ordinals
  for "odd one out", zero..k for "how many images", yes/no for "same shape") is the answer; ``right_blank`` the same
  with every image gray (the base rate a reading must beat); ``answers``: how often each candidate is the argmax;
- the mass of each supervised hop (the set targets of ``training/target/set_referents.py`` and ``training/target/set_count.py``, at the
  layers and heads a run trained them on) on what it should land on, and on where it should not:
  ``which``: the reader on the named image's objects and on the other images' objects, the ordinal hop on the
  ordinal; ``odd``: the mean hop on every object, the odd hop on the odd image's objects and on all objects;
  ``count``: the summary hops on their image's objects, the count hop on the first token by the number m of
  matching images, on the matching images' summary tokens and on the others'.

A hop that has learnt to *land* (mass on objects) but not to *choose* shows as a share on the right image near
1 / (images in the set): the reading the odd and count hops first gave (zoo/TRAINING.md, "Image sets: counting images,
and the odd one out against the set's look").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.world.sample import Sample
from specula.world.vocab import COLOUR_NAMES, NUMBER_WORDS, ORDINALS
from specula.training.target.referents import ReferentTarget, answer_spans, eager_attention

PROBE_OFFSET = 30_000  # eval-split indices past the gates' (training/target/evaluate.py EVAL_OFFSET) and the training checks'
KINDS = ("which", "odd", "count", "same")


@dataclass(frozen=True)
class SetLayout:
    """Where a set's pieces sit in one encoded sample (token positions)."""

    objects: tuple[tuple[int, ...], ...]  # each image's object patches
    summaries: tuple[int, ...]  # the token after each image (set_count's summary tokens); () without markers


def candidates(s: Sample) -> tuple[str, ...]:
    """The words an answer of this kind can be: # a tuple of single words."""
    kind, k = s.kind.split("/")[-1], len(s.images)
    if kind == "which":
        return COLOUR_NAMES
    if kind == "odd":
        return ORDINALS[:k]
    if kind == "count":
        return NUMBER_WORDS[:k + 1]
    if kind == "same":
        return ("yes", "no")
    raise ValueError(f"not an image-set question: {s.kind!r}")


def pick(logits: torch.Tensor, ids: Sequence[int]) -> int:
    """The index into ``ids`` of the candidate token with the highest logit. logits # [V]"""
    return int(logits[torch.tensor(list(ids), dtype=torch.long)].argmax())


def mass(attn: torch.Tensor, head: int, query: int, keys: Sequence[int]) -> float:
    """A head's attention mass from ``query`` on ``keys``. attn # [heads, L, L] one layer's softmax weights."""
    return float(attn[head, query, list(keys)].sum()) if keys else 0.0


def read_hops(attentions: Sequence[torch.Tensor], targets: Sequence[ReferentTarget],
              layout: SetLayout) -> dict[str, float | tuple[int, float]]:
    """Each supervised hop's masses in one sample.

    attentions: per decoder layer # [heads, L, L]; targets: the sample's set targets (a count target's patches are
    the first token and the summaries of the images that show the asked shape). Keys: ``reader_named`` /
    ``reader_other`` / ``ordinal_hop`` ("set"),
    ``mean_hop_objects`` / ``odd_hop_odd`` / ``odd_hop_objects`` / ``odd_share`` (odd over objects) / ``odd_share_even``
    (what an even spread over the object patches gives) ("set_odd": the spread target is the mean hop),
    ``summary_hop`` (mean over images), ``count_first`` ((m, mass on the first token)), ``count_matching`` /
    ``count_other`` and the same per summary token, ``count_matching_each`` / ``count_other_each`` ("set_count":
    the target on the first token), ``count_word_hop`` (its word hop on the asked shape word).
    """
    every = tuple(p for obj in layout.objects for p in obj)
    out: dict = {}
    summary = []
    for t in targets:
        a = attentions[t.patch_layer]
        if t.group == "set":
            named = set(t.patches)
            out["reader_named"] = mass(a, t.head, t.query, t.patches)
            out["reader_other"] = mass(a, t.head, t.query, [p for p in every if p not in named])
            if t.words:
                wh = t.head if t.word_head is None else t.word_head
                out["ordinal_hop"] = mass(attentions[t.word_layer], wh, t.query, t.words)
        elif t.group == "set_odd" and t.spread:
            out["mean_hop_objects"] = mass(a, t.head, t.query, every)
        elif t.group == "set_odd":
            out["odd_hop_odd"] = mass(a, t.head, t.query, t.patches)
            out["odd_hop_objects"] = mass(a, t.head, t.query, every)
            # of the hop's mass on objects, the odd image's share, beside what an even spread over the patches gives
            out["odd_share"] = out["odd_hop_odd"] / max(out["odd_hop_objects"], 1e-12)
            out["odd_share_even"] = len(t.patches) / len(every)
        elif t.group == "set_count" and t.patches and t.patches[0] == 0:
            matching = list(t.patches[1:])
            others = [p for p in layout.summaries if p not in set(matching)]
            out["count_first"] = (len(matching), mass(a, t.head, t.query, [0]))
            out["count_matching"] = mass(a, t.head, t.query, matching)
            out["count_other"] = mass(a, t.head, t.query, others)
            if t.words:  # the word hop that puts the asked shape on the count hop's query
                wh = t.head if t.word_head is None else t.word_head
                out["count_word_hop"] = mass(attentions[t.word_layer], wh, t.query, t.words)
            if matching:  # per summary token: a hop that tells them apart puts more on each matching one
                out["count_matching_each"] = out["count_matching"] / len(matching)
            if others:
                out["count_other_each"] = out["count_other"] / len(others)
        elif t.group == "set_count":
            summary.append(mass(a, t.head, t.query, t.patches))
    if summary:
        out["summary_hop"] = sum(summary) / len(summary)
    return out


def layout_of(s: Sample, input_ids: torch.Tensor, image_id: int) -> SetLayout | None:
    from specula.training.target.set_referents import object_patches, set_image_tokens

    got = set_image_tokens(s, input_ids, image_id)
    if got is None:
        return None
    n_tok, pos = got
    objects = tuple(tuple(pos[n * n_tok + t] for t in object_patches(w)) for n, w in enumerate(s.patch_words))
    after = [pos[(n + 1) * n_tok - 1] + 1 for n in range(len(s.images))]
    marked = all(int(input_ids[j]) != image_id for j in after[:-1])
    return SetLayout(objects, tuple(after) if marked else ())


@torch.inference_mode()
def _forward(model, enc, attentions: bool):
    lm = model.model.language_model
    with eager_attention(lm, attentions):
        return model(input_ids=enc.input_ids[None], pixel_values=enc.pixel_values,
                     attention_mask=torch.ones_like(enc.input_ids)[None], output_attentions=attentions)


def probe_sets(model, processor, n: int = 200, set_hops: str = "reader", seed: int = 0, progress: bool = True) -> dict:
    """The reading above over the first ``n`` probe questions of the image-set suite (JSON-ready)."""
    from tqdm import tqdm

    from specula.world.suites import generate
    from specula.training.target.batching import Encoder
    from specula.training.target.quality import blank_like

    enc = Encoder(processor, set_referents=True, set_marks=True, set_hops=set_hops, set_odd=True, set_count=True)
    sums: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in KINDS}
    answers: dict[str, dict[str, int]] = {k: defaultdict(int) for k in KINDS}
    first_by_m: dict[int, list[float]] = defaultdict(list)
    for i in tqdm(range(n), desc="probe sets", disable=not progress):
        s = generate("multi_image", "eval", PROBE_OFFSET + i, seed)
        kind = s.kind.split("/")[-1]
        if kind not in KINDS:
            continue
        words = candidates(s)
        ids = [enc.word_id(w) for w in words]
        e = enc.encode(s)
        start = answer_spans(e.labels)[0][0]
        out = _forward(model, e, attentions=True)
        got = words[pick(out.logits[0, start - 1], ids)]
        sums[kind]["right"].append(float(got == s.answer))
        answers[kind][got] += 1
        blank = enc.encode(blank_like(s))
        bout = _forward(model, blank, attentions=False)
        sums[kind]["right_blank"].append(float(words[pick(bout.logits[0, start - 1], ids)] == s.answer))
        layout = layout_of(s, e.input_ids, enc.image_id)
        if layout is None:
            continue
        hops = read_hops([a[0] for a in out.attentions], e.referents, layout)
        for key, v in hops.items():
            if key == "count_first":
                first_by_m[v[0]].append(v[1])
            else:
                sums[kind][key].append(v)
    report: dict = {"n": n, "set_hops": set_hops}
    for kind in KINDS:
        if not sums[kind]["right"]:
            continue
        row = {"questions": len(sums[kind]["right"])}
        row.update({k: round(sum(v) / len(v), 3) for k, v in sums[kind].items() if v})
        row["answers"] = dict(sorted(answers[kind].items(), key=lambda kv: -kv[1]))
        report[kind] = row
    if first_by_m:
        report["count"]["count_first_by_m"] = {str(m): round(sum(v) / len(v), 3)
                                               for m, v in sorted(first_by_m.items())}
    return report


def markdown(report: dict) -> str:
    """One table row per question type."""
    lines = ["| question | n | right | right, blank | hops |", "| --- | ---: | ---: | ---: | --- |"]
    for kind in KINDS:
        r = report.get(kind)
        if not r:
            continue
        hops = ", ".join(f"{k} {v}" for k, v in r.items()
                         if k not in ("questions", "right", "right_blank", "answers"))
        lines.append(f"| {kind} | {r['questions']} | {r['right']:.3f} | {r.get('right_blank', 0):.3f} | {hops} |")
    return "\n".join(lines)


def _refuse_unfit(model, set_hops: str) -> None:
    """A clear refusal when a hop the probe reads sits on a layer or head the model does not have."""
    from specula.training.target.set_count import set_count_hops
    from specula.training.target.set_referents import SET_HOPS, hops_in_use

    used = hops_in_use(SET_HOPS[set_hops], True, True, True, odd=True)
    used.update(set_count_hops())
    cfg = model.config.text_config
    for name, (layer, head) in used.items():
        if layer >= cfg.num_hidden_layers or head >= cfg.num_attention_heads:
            raise SystemExit(f"the {name} hop (layer {layer}, head {head}; --set-hops {set_hops}) is not in this "
                             f"model: {cfg.num_hidden_layers} layers of {cfg.num_attention_heads} heads")


def probe_sets_cli(args) -> int:
    from specula.training.target.evaluate import load_checkpoint, load_model
    from research.probe_output import emit

    if args.n <= 0:
        raise SystemExit("--n must be > 0")
    if args.checkpoint:
        model, processor, state = load_checkpoint(args.checkpoint)
        hops = args.set_hops or state["config"].get("set_hops") or "reader"
    else:
        model, processor = load_model(args.model)
        hops = args.set_hops or "reader"
    _refuse_unfit(model, hops)
    report = probe_sets(model, processor, n=args.n, set_hops=hops, seed=args.seed)
    report["model"] = args.checkpoint or args.model
    emit(report, markdown(report), args.out, "probe_sets", args.json)
    return 0
