"""``specula zoo eval``: the target's quality gates on held-out suites, each beside its blank-image control.

Gates (from the trained-target issue): VQA exact >= 0.90; the same questions with blank images <= chance + 0.10;
caption attribute recall >= 0.85. Chart, OCR, multi-image and video are reported with their blank controls. The VQA
questions are also asked with a held-out line of text before the image, with the question before the image, and after
a system turn (``vqa_exact_lead`` / ``_question_first`` / ``_system``; world/placed.py): how API users write prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from specula.world.placed import VARIANTS, variant
from specula.world.suites import SUITES, generate
from specula.training.target.quality import (CAPTION_TOKENS, answers_by_type, attribute_recall, blank_like, by_question_type,
                                 caption_attribute_recall, chance_level, greedy_answer, object_precision, object_recall,
                                 short_answer_accuracy, short_answer_hits, short_answers, which_image_by_place)

GATES = {"vqa_exact_min": 0.90, "blank_margin_max": 0.10, "caption_attribute_recall_min": 0.85}
EVAL_OFFSET = 20_000  # eval indices used by gates; training-time tracking uses 10_000.. of the same split


def load_model(model_ref: str):
    from transformers import LlavaForConditionalGeneration

    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    path = resolve(model_ref)
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, load_processor(path)


def load_checkpoint(ckpt: str):
    """A training checkpoint (``runs/X/ckpt``: fp32 safetensors + state.json) as ``zoo export`` would store it:
    every weight rounded to fp16, computed in fp32. Returns (model, processor, state)."""
    from safetensors.torch import load_file

    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    path = Path(ckpt)
    if not (path / "state.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path}: not a training checkpoint (needs state.json and model.safetensors)")
    state = json.loads((path / "state.json").read_text())
    processor = load_processor(TOKENIZER_DIR)
    processor.number_images = bool(state["config"].get("number_images", False))  # the prompt form it trained on
    model = build_model(TargetArch.from_name(state["config"]["arch"]), processor.tokenizer)
    sd = {k: v.to(torch.float16).to(torch.float32) for k, v in load_file(path / "model.safetensors").items()}
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model.eval(), processor, state


def shallow_layers(state: dict) -> int:
    """The decoder layers a checkpoint's LM computes with: a shallow code LM stage that has not finished has trained
    only its first ``code_lm_layers`` (the others become identities at the stage's end), so a mid-stage checkpoint
    is read through those alone; 0 = all layers."""
    cfg = state.get("config", {})
    if cfg.get("code_lm_layers") and "code_lm_grown_from" not in state:
        return int(cfg["code_lm_layers"])
    return 0


def code_readout(model, processor, state: dict, n: int = 100, seed: int = 0, suite: str = "vqa") -> dict:
    """The LM's reading of exact word codes in place of the image tokens (its ceiling: a perfect tower), and of zero
    codes, on the same held-out questions of ``suite`` as ``evaluate``; for VQA beside it ``tower_readout`` on the
    first 40 of their images (``tower_<attribute>``); for captions their attribute recall. Only for word-code
    checkpoints."""
    from specula.training.target.code_stages import code_answer_hits, code_answers
    from specula.training.target.word_codes import WordCodes

    cfg = state["config"]
    if not cfg.get("code_lm_samples"):
        raise ValueError("--codes needs a word-code checkpoint (trained with --code-lm-samples)")
    codes = WordCodes(model.config.text_config.hidden_size, cfg["seed"])
    layers = shallow_layers(state)
    if suite == "caption":  # the captions' attribute recall from exact codes and from zero codes
        samples = [generate(suite, "eval", EVAL_OFFSET + i, seed) for i in range(n)]
        def captions(blank: bool) -> list[str]:
            return code_answers(model, processor, codes, samples, blank=blank, max_new_tokens=CAPTION_TOKENS,
                                layers=layers)

        written = captions(False)
        return {"caption_attribute_recall": attribute_recall(samples, written),
                "caption_object_precision": object_precision(samples, written),
                "caption_object_recall": object_recall(samples, written),
                "caption_attribute_recall_zero_codes": attribute_recall(samples, captions(True))}
    samples = [s for s in (generate(suite, "eval", EVAL_OFFSET + i, seed) for i in range(n)) if s.answer]
    hits = code_answer_hits(model, processor, codes, samples, layers=layers)
    blank = code_answer_hits(model, processor, codes, samples, blank=True, layers=layers)
    out = {"exact": sum(hits) / max(1, len(samples)), "exact_zero_codes": sum(blank) / max(1, len(samples))}
    if suite == "vqa":
        out.update({f"tower_{k}": v for k, v in tower_readout(model, processor, codes, n=min(n, 40), seed=seed).items()})
    if any("/" in s.kind for s in samples):
        out["by_type"] = by_question_type(samples, hits, blank)
    return out


def tower_readout(model, processor, codes, n: int = 40, seed: int = 0) -> dict[str, float]:
    """How well the tower + projector say each attribute of an object: every object patch of ``n`` held-out VQA
    images is decoded against the word codes: the (colour, shape, size, place) whose summed codes are nearest to
    the patch's token (all 864 combinations; exact on exact codes). Returns the fraction decoded right per
    attribute over the object patches."""
    import itertools

    from specula.world.vocab import COLOUR_NAMES, POSITIONS, SHAPES, SIZES
    from specula.training.target.batching import Encoder
    from specula.training.target.vision_heads import tower_features

    combos = [(c, s, z, tuple(p.split())) for c, s, z, p in
              itertools.product(COLOUR_NAMES, SHAPES, SIZES, POSITIONS.values())]
    cands = torch.stack([codes.patch((c, s, z, *p)) for c, s, z, p in combos])  # [864, H]
    enc = Encoder(processor)
    names = ("colour", "shape", "size", "place")
    hits: dict[str, list[bool]] = {k: [] for k in names}
    with torch.no_grad():
        for i in range(n):
            s = generate("vqa", "eval", EVAL_OFFSET + i, seed)
            _, img = tower_features(model, enc.encode(s).pixel_values)  # [1, T, H]
            obj = [t for t, words in enumerate(s.patch_words[0]) if len(words) >= 4]  # background patches: no words
            if not obj:
                continue
            x = img[0, obj].float()  # [P, H]
            best = torch.cdist(x, cands).argmin(-1).tolist()  # [P]
            for t, b in zip(obj, best):
                words = s.patch_words[0][t]
                truth = (words[0], words[1], words[2], tuple(words[3:]))
                for k, got, want in zip(names, combos[b], truth):
                    hits[k].append(got == want)
    return {k: sum(v) / max(1, len(v)) for k, v in hits.items()}


def _chart_question(s):
    """The chart sample with its question type in its kind: ``chart/bar`` -> ``chart/bar value``."""
    import dataclasses

    from specula.world.charts import question_type

    chart = s.kind.split("/", 1)[1]
    return dataclasses.replace(s, kind=f"{s.kind} {question_type(chart, s.prompt.replace('<image>', ''))}")


def evaluate(model, processor, n: int = 100, suites: list[str] | None = None, seed: int = 0,
             forms: tuple[str, ...] = VARIANTS) -> dict:
    """Every suite asked for on its first ``n`` held-out samples, each beside its blank-image control; the VQA
    questions also in each of ``forms`` (world/placed.py: the image off the start of the prompt)."""
    out: dict = {"n_per_suite": n, "suites": {}}
    bar = tqdm(suites or list(SUITES), desc="zoo eval", unit="suite", leave=False)
    for name in bar:
        bar.set_postfix_str(name)
        samples = [generate(name, "eval", EVAL_OFFSET + i, seed) for i in range(n)]
        r: dict = {}
        if name == "caption":
            written = [greedy_answer(model, processor, s, CAPTION_TOKENS) for s in samples]
            r["caption_attribute_recall"] = attribute_recall(samples, written)
            r["caption_object_precision"] = object_precision(samples, written)  # no gate: what recall leaves out
            r["caption_object_recall"] = object_recall(samples, written)  # no gate: colour and shape named together
            r["caption_attribute_recall_blank_image"] = caption_attribute_recall(model, processor, [blank_like(s) for s in samples])
        elif name == "text":
            qa = [s for s in samples if s.answer]
            r["exact"] = short_answer_accuracy(model, processor, qa)
        else:
            answers = short_answers(model, processor, samples)
            hits = short_answer_hits(model, processor, samples, answers=answers)
            blank_hits = short_answer_hits(model, processor, samples, blank=True)
            r["exact"] = sum(hits) / max(1, len(samples))
            r["exact_blank_image"] = sum(blank_hits) / max(1, len(samples))
            if any("/" in s.kind for s in samples):
                r["by_type"] = by_question_type(samples, hits, blank_hits)
                r["answers_by_type"] = answers_by_type(samples, answers)  # a format never learnt vs a prior
            if name == "chart":  # bars, lines and pies each by question type ("bar value", "line trend", ...)
                r["by_question"] = by_question_type([_chart_question(s) for s in samples], hits, blank_hits)
            if name == "multi_image":  # does the LM read every image of a set, or only the first?
                r["which_by_place"] = which_image_by_place(samples, answers)
            if name == "vqa":  # the same questions asked with the image off the start of the prompt (world/placed.py)
                for form in forms:
                    r[f"exact_{form}"] = short_answer_accuracy(model, processor, [variant(s, form) for s in samples])
            chance = chance_level(samples)
            if chance is not None:
                r["chance"] = chance
        out["suites"][name] = r
    s = out["suites"]
    if "vqa" in s:
        out["vqa_exact"] = s["vqa"]["exact"]
        out["vqa_exact_blank_image"] = s["vqa"]["exact_blank_image"]
        out["vqa_chance"] = s["vqa"]["chance"]
        for form in forms:  # reported, no gate: the cycle-2 target answers these at its blank-image level
            out[f"vqa_exact_{form}"] = s["vqa"][f"exact_{form}"]
    if "caption" in s:
        out["caption_attribute_recall"] = s["caption"]["caption_attribute_recall"]
    out["gates"] = gates(out)
    return out


def gates(r: dict) -> dict:
    g = {}
    if "vqa_exact" in r:
        g["vqa_exact"] = r["vqa_exact"] >= GATES["vqa_exact_min"]
        g["vqa_blank_near_chance"] = r["vqa_exact_blank_image"] <= r["vqa_chance"] + GATES["blank_margin_max"]
    if "caption_attribute_recall" in r:
        g["caption_attribute_recall"] = r["caption_attribute_recall"] >= GATES["caption_attribute_recall_min"]
    return g


def eval_cli(args) -> int:
    suites = [x for x in (args.suites or "").split(",") if x] or None
    unknown = sorted(set(suites or []) - set(SUITES))
    if unknown:
        raise SystemExit(f"--suites: unknown {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if args.scan_cells and suites is not None and "caption" not in suites:
        raise SystemExit("--scan-cells reads the caption suite's scenes: add caption to --suites")
    if args.checkpoint:
        model, processor, state = load_checkpoint(args.checkpoint)
    else:
        if args.codes:
            raise SystemExit("--codes needs --checkpoint (a word-code training checkpoint)")
        model, processor = load_model(args.model)
    r = evaluate(model, processor, n=args.n, suites=suites)
    if args.codes:  # every image suite asked for (short answers and captions), read from exact and zero codes too
        for name in [x for x in list(r["suites"]) if x != "text"]:
            r["suites"][f"{name}_codes"] = code_readout(model, processor, state, n=args.n, suite=name)
    if args.scan_cells:  # the reference scan listing, teacher-forced: each cell's opening word (training/target/scan_cells.py)
        from specula.training.target.scan_cells import scan_cells

        r["suites"]["caption_scan_cells"] = scan_cells(model, processor, n=args.n, offset=EVAL_OFFSET)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        for name, v in r["suites"].items():
            print(f"{name:12s} " + "  ".join(f"{k}={x:.3f}" if isinstance(x, float) else f"{k}={x}"
                                             for k, x in v.items() if k not in ("by_type", "by_question",
                                                                                 "which_by_place")))
            for qtype, t in {**v.get("by_type", {}), **v.get("by_question", {})}.items():
                print(f"  {qtype:18s} n={t['n']:<4d} exact={t['exact']:.3f}  blank_image={t['exact_blank_image']:.3f}")
            for place, t in v.get("which_by_place", {}).items():
                print(f"  which, {place + ' image':13s}n={t['n']:<4d} exact={t['exact']:.3f}  "
                      f"first_image_colour={t['first_image_colour']:.3f}")
        print("gates: " + ", ".join(f"{k}={'pass' if ok else 'FAIL'}" for k, ok in r["gates"].items()))
    return 0
