"""``specula generate``: answer a question about images through the engine.

With a drafter (``DEFAULT_DRAFTER`` unless ``--drafter`` names another) the answer is decoded speculatively and,
unless ``--no-compare``, plain decoding of the same question runs in the same process: one warm-up of each, then
``--repeats`` timed runs of each, round robin (the fastest of each counts). Greedy outputs must be identical
(lossless), and the run prints tau and the speedup over plain decoding.
``--drafter none`` decodes plainly and prints tokens/s only. ``--drafter`` takes what ``specula serve --drafter``
takes (runtime/config_front_door.py ``drafter_from_ref``): a trained drafter's directory, a shipped drafter or a
kind; a drafter whose record (``specula.json``) names other target weights than the model's is refused naming both
fingerprints (runtime/config_records.py). The default drafter's shipped weights are the embedded target's: on any
other model, without ``--drafter``, it drafts with ``FALLBACK_DRAFTER`` (the serving config's default) and says so
on stderr. A question without images and without ``--drafter`` drafts with the serving config's text-only choice
(``TEXT_DRAFTER``, runtime/config.py ``BEST_TEXT_DRAFTER``) where it was trained for the model.
``add_generate_arguments`` is the command's flags; parsing them imports neither torch nor the drafters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from specula.runtime.config import BEST_TEXT_DRAFTER, DrafterConfig

# The drafter `specula generate` (and so `make run`) uses: the best over all suites in the newest full bench report
# (reports/2026-12-02-linux-x86_64-2c: flash 1.19x over plain decoding, captions 2.08x; next text_lm and pooled
# 1.11x). The serving config's default (runtime/config.py default_drafter_kind) is the same choice.
DEFAULT_DRAFTER = "flash"
FALLBACK_DRAFTER = "ngram"  # the default on a model the default drafter was not trained for: needs no weights
TEXT_DRAFTER = BEST_TEXT_DRAFTER  # the default for a question without images (config drafter.text_only's choice)
# Draft tokens per block: the serving config's most (runtime/config.py DrafterConfig.gamma). Here every block
# drafts that many, so the drafter's own tau and speedup show; `specula serve` chooses 0..gamma per step.
DEFAULT_GAMMA = DrafterConfig.model_fields["gamma"].default


class _Chosen(argparse.Action):
    """Stores ``--drafter`` and notes that it was given (the default alone may fall back to ``FALLBACK_DRAFTER``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.drafter_given = True


def add_generate_arguments(p) -> None:
    """The ``specula generate`` flags on argparse parser ``p``."""
    p.add_argument("--image", action="append", default=[], help="image file (repeat for several images)")
    p.add_argument("--question", required=True,
                   help="the user's question; '<image>' marks where each image goes (default: images first)")
    p.add_argument("--system", default="", help="a system message before the question (default: none; the "
                                                "checkpoint's chat template may add its own)")
    p.add_argument("--model", "--target", dest="model", default="target",
                   help="zoo entry name or local HF checkpoint directory (LLaVA-1.5, Qwen2.5-VL or ours); the prompt "
                        "is built by its own processor and chat template (default: target)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, action=_Chosen, metavar="KIND|DIR",
                   help=f"a trained drafter's directory (its specula.json names the kind and the target weights it "
                        f"was trained for, checked against --model's), a drafter kind (specula.drafters.kinds(), "
                        f"with its shipped weights), or none for plain decoding only (default: {DEFAULT_DRAFTER}, "
                        f"or {TEXT_DRAFTER} for a question without images, whose weights are the embedded "
                        f"target's; on another model {FALLBACK_DRAFTER})")
    p.set_defaults(drafter_given=False)
    p.add_argument("--gamma", type=int, default=DEFAULT_GAMMA,
                   help=f"draft tokens per block, every block (`specula serve` drafts up to its drafter.gamma, "
                        f"as many as pay per step) (default: {DEFAULT_GAMMA})")
    p.add_argument("--no-compare", action="store_true",
                   help="with a drafter, skip the plain-decoding run (no speedup, no losslessness check)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each, round robin after the warm-up; the fastest of each counts (default: 3)")
    p.add_argument("--max-tokens", type=int, default=96, help="maximum new tokens (default: 96)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; speculative text is checked equal to plain's); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")


class LosslessnessError(AssertionError):
    """Greedy speculative decoding emitted other text than plain greedy decoding of the same prompt."""


def load_images(paths: list[str]) -> list[Image.Image]:
    images = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"image {p!r} does not exist")
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"image {p!r} cannot be read: {e}") from None
    return images


@dataclass(frozen=True)
class Timed:
    """One request run to completion on one engine, with its wall time (prefill included)."""

    result: object  # GenerationResult
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.result.tokens) / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2),
                "prefill_s": round(self.result.metrics.time["prefill"], 4)}


def _run(engine, request_id: str, prompt, params) -> Timed:
    """``prompt``: an ``EncodedPrompt`` (runtime/engine/prompts.py)."""
    t0 = time.perf_counter()
    res = engine.generate([prompt.request(request_id, params)])[request_id]
    return Timed(res, time.perf_counter() - t0)


def _check_args(args) -> bool:
    """Whether ``args`` asks for a drafter (``--drafter none``: plain decoding), after checking the numbers."""
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.drafter.lower() == "none":
        return False
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if args.gamma < 1:
        raise ValueError("--gamma must be at least 1 (--drafter none decodes plainly)")
    return True


def _drafter_spec(ref: str) -> dict:
    """``{"kind", "options"}`` of a drafter directory, shipped drafter or kind, as ``specula serve`` reads it."""
    from specula.runtime.config import ConfigError
    from specula.runtime.config_front_door import drafter_from_ref
    from specula.runtime.engine.local_drafter import check_kind

    try:
        return drafter_from_ref(ref)
    except ConfigError:
        if not Path(ref).exists():
            check_kind(ref)  # not a kind either: the known kinds by name, and none
        raise


def choose_drafter(args, model_path) -> tuple[str, dict]:
    """(kind, options) of the drafter ``args`` asks for, its record checked against ``model_path``'s weights
    (runtime/config_records.py, as ``specula serve`` checks it); the default drafter falls back to
    ``FALLBACK_DRAFTER`` with a note on stderr where its record names other weights."""
    from specula.runtime.config_records import record_mismatches

    spec = _drafter_spec(args.drafter)
    problems = record_mismatches(str(model_path), DrafterConfig(**spec))
    if problems and not getattr(args, "drafter_given", True):
        print(f"specula generate: the default drafter {args.drafter!r} was trained for another target than "
              f"{model_path}; drafting with {FALLBACK_DRAFTER!r} (--drafter KIND|DIR chooses another)",
              file=sys.stderr)
        return FALLBACK_DRAFTER, {}
    if problems:
        raise ValueError("; ".join(problems) + f" (--drafter {FALLBACK_DRAFTER} needs no weights)")
    return spec["kind"], dict(spec.get("options") or {})


def main(args) -> int:
    speculative = _check_args(args)
    images = load_images(args.image)
    from specula.runtime.config import trained_for
    from specula.zoo.store import resolve

    path = resolve(args.model)
    if speculative and not images and not getattr(args, "drafter_given", True) and trained_for(TEXT_DRAFTER, path):
        args.drafter = TEXT_DRAFTER  # a text-only question: the text drafter, as specula serve routes it
    kind, options = choose_drafter(args, path) if speculative else (None, {})
    import torch
    from transformers.utils import logging as hf_logging

    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.local_drafter import build_local_drafter
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.engine.prompts import encode_prompt, eos_ids
    from specula.targets import load_target
    from specula.targets.processor import load_processor

    hf_logging.disable_progress_bar()  # the weight-loading bar would sit between the command and its answer
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    processor = load_processor(path)
    tok = processor.tokenizer
    target = load_target(str(path), device=args.device)
    prompt = encode_prompt(processor, args.question, images, system=args.system)  # the checkpoint's template
    ids = prompt.input_ids  # [L]
    kw = dict(eos_token_ids=eos_ids(tok, target), decode=lambda t: tok.decode(t, skip_special_tokens=True))
    plain = SpecEngine(target, None, **kw)
    if kind is None:
        return _report(args, path, ids, _run(plain, "plain", prompt, params), None, None)
    try:
        drafter = build_local_drafter({"kind": kind, **options}, target, tok)
    except ValueError as e:
        raise ValueError(f"drafter {kind!r} cannot draft for {path}: {e} (--drafter none decodes plainly)") from None
    spec = SpecEngine(target, drafter, gamma=args.gamma, **kw)
    if args.no_compare:
        return _report(args, path, ids, None, _run(spec, "spec", prompt, params), kind, options.get("path"))
    for name, engine in (("plain", plain), ("spec", spec)):  # first calls allocate and pick kernels
        _run(engine, f"warm-{name}", prompt, params)
    base, fast = None, None
    for i in range(args.repeats):  # round robin, so load on a shared machine hits both alike; the fastest counts
        b, f = _run(plain, f"plain-{i}", prompt, params), _run(spec, f"spec-{i}", prompt, params)
        if args.temperature == 0 and f.result.tokens != b.result.tokens:
            raise LosslessnessError(f"speculative decoding with {kind} changed the greedy output: losslessness "
                                    f"broke\n  plain:       {b.result.text!r}\n  speculative: {f.result.text!r}")
        base = b if base is None or b.seconds < base.seconds else base
        fast = f if fast is None or f.seconds < fast.seconds else fast
    return _report(args, path, ids, base, fast, kind, options.get("path"))


def _report(args, path, ids, base: Timed | None, fast: Timed | None, kind: str | None,
            drafter_path: str | None = None) -> int:
    """Print the answer and the figures of the runs made (``base`` plain, ``fast`` speculative); ``drafter_path``:
    the drafter's weights (a directory or a zoo entry), None for a kind without weights."""
    shown = fast or base
    res = shown.result
    record = {"answer": res.text, "new_tokens": len(res.tokens), "model": str(path), "prompt_tokens": int(ids.numel()),
              "finish_reason": res.finish_reason, "drafter": kind, "drafter_path": drafter_path,
              "gamma": args.gamma if kind else None,
              "tau": round(fast.result.metrics.tau, 3) if fast else None,
              "alpha": [round(a, 3) for a in fast.result.metrics.alpha] if fast else None,
              "speculative": fast.to_dict() if fast else None, "plain": base.to_dict() if base else None,
              "speedup": round(base.seconds / fast.seconds, 3) if base and fast else None,
              "identical": (fast.result.tokens == base.result.tokens) if base and fast else None}
    if args.json:
        print(json.dumps(record))
        return 0
    print(res.text)
    n = len(res.tokens)
    if fast:
        m = fast.result.metrics
        print(f"[speculative, {kind} drafter, gamma {args.gamma}: tau {m.tau:.2f} ({n} tokens in {m.blocks} target "
              f"passes after prefill); {fast.seconds:.2f} s, {fast.tokens_per_s:.1f} tokens/s]")
    if base:
        same = ("; same text" if record["identical"] else "; sampled, so the text may differ") if fast else ""
        print(f"[plain decoding: {len(base.result.tokens)} tokens in {base.seconds:.2f} s, "
              f"{base.tokens_per_s:.1f} tokens/s{same}]")
    if record["speedup"] is not None:
        print(f"[speedup {record['speedup']:.2f}x over plain decoding (same question, same run; fastest of "
              f"{args.repeats} each after a warm-up)]")
    print(f"[model {path}, {record['prompt_tokens']} prompt tokens, prefill "
          f"{res.metrics.time['prefill'] * 1e3:.0f} ms]")
    return 0
