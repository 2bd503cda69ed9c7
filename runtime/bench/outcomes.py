"""``specula bench outcomes``: how far drafting ahead *can* go, before any timing.

A block drafted ahead while block n is verified is usable only if block n's verdict is the outcome it was drafted
for: the whole block accepted and the bonus token equal to the drafter's guess (PEARL's post-verify), or one of
the rejection outcomes "nodes 0 .. k-1 accepted, the target's token at k is t" that a ``Predraft`` drafter ranks
and drafts for (SSD / Saguaro). However cheap drafting gets (batched branches, more replicas), the share of
blocks whose real outcome is among the drafter's top m predicted outcomes caps the share of blocks that can be
ready when their verdict arrives. This command measures that curve in one process, with no timing at all:

    top-1   the guess alone (pipelined)
    top-m   the guess plus the m - 1 likeliest rejection outcomes (predraft with m - 1 branches)

The drafter runs under a plain ``SpecEngine`` (greedy): it proposes gamma + 1 nodes and the last one, its guess,
is not sent; before each verdict is observed the drafter's ``branch`` ranks up to ``--top - 1`` rejection outcomes
(nothing is drafted for them). A request's first block is drafted after prefill and can never be ready ahead, so
the curve is also given over the blocks after each request's first. A request's last block is left out: no
block follows it, so nothing could be drafted ahead for it (and a verdict cut short by max_tokens or EOS is not a
rejection).

    specula bench outcomes                          # shipped target + text_lm, 6 prompts x 5 suites
    specula bench outcomes --gamma 2 --top 16 --out reports/outcomes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path


class OutcomeRecorder:
    """Wraps a ``Predraft`` drafter for a ``SpecEngine``: records the rank of every verdict's outcome among the
    drafter's predicted outcomes (0 = its guess; -1 = not among the ``top`` it ranked)."""

    def __init__(self, drafter, top: int) -> None:
        from specula.drafters.protocol import supports_predraft  # torch: not at parse time

        if not supports_predraft(drafter):
            raise ValueError("bench outcomes needs a drafter that ranks rejection outcomes (Predraft: text_lm)")
        self.drafter, self.top = drafter, top
        self._guess: dict[str, tuple[int, int | None]] = {}  # request -> (nodes sent, guess)
        self._seen: set[str] = set()
        self.ranks: list[tuple[int, bool]] = []  # (rank, first block of its request), blocks followed by another
        self._last: dict[str, tuple[int, bool]] = {}  # request -> its newest block, counted once another follows

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, request_ids, gamma: int):
        prop = self.drafter.propose(request_ids, gamma + 1)
        counts = []
        for b, rid in enumerate(request_ids):
            c = int(prop.counts[b])
            guess = int(prop.tokens[b, gamma]) if c == gamma + 1 else None
            self._guess[rid] = (min(c, gamma), guess)
            counts.append(min(c, gamma))
        cut = prop.tokens[:, :gamma]  # [B, gamma]
        q = None if prop.q is None else prop.q[:, :gamma]  # [B, gamma, V]
        return dataclasses.replace(prop, tokens=cut, counts=tuple(counts), q=q)

    def observe(self, verdicts) -> None:
        for v in verdicts:
            rid = v.request_id
            sent, guess = self._guess.pop(rid, (0, None))
            outcomes = [(sent, guess)] if guess is not None else []
            while len(outcomes) < self.top:
                o = self.drafter.branch([(rid, sent)])[0]  # opens a hidden branch; observe drops it below
                if o is None:
                    break
                outcomes.append((int(o[0]), int(o[1])))
            real = (len(v.accepted), int(v.next_token))
            rank = outcomes.index(real) if real in outcomes and list(v.accepted) == list(range(real[0])) else -1
            if rid in self._last:
                self.ranks.append(self._last[rid])
            self._last[rid] = (rank, rid not in self._seen)
            self._seen.add(rid)
        self.drafter.observe(verdicts)

    def release(self, request_ids) -> None:
        for rid in request_ids:  # the request's last block: nothing follows it
            self._last.pop(rid, None)
            self._seen.discard(rid)
        self.drafter.release(request_ids)


def coverage(ranks: list[int], top: int) -> dict[str, float]:
    """Share of blocks whose outcome ranks below m, for m = 1 .. top."""
    n = max(1, len(ranks))
    count = Counter(ranks)
    out, cum = {}, 0
    for m in range(1, top + 1):
        cum += count.get(m - 1, 0)
        out[str(m)] = round(cum / n, 4)
    return out


def measure(target, drafter, prompts, gamma: int, max_tokens: int, top: int, eos_token_ids=()) -> dict:
    """Run every prompt greedily through ``SpecEngine(target, OutcomeRecorder(drafter))``; the coverage curves."""
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.core.sampling import SamplingParams

    rec = OutcomeRecorder(drafter, top)
    engine = SpecEngine(target, rec, gamma=gamma, eos_token_ids=list(eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for _suite, pid, prompt in prompts:  # (suite, id, EncodedPrompt), as bench.spec.encoded_prompts gives them
        engine.generate([prompt.request(pid, params)])
    ranks = [r for r, _ in rec.ranks]
    later = [r for r, first in rec.ranks if not first]
    return {"blocks": len(ranks), "first_blocks": len(ranks) - len(later), "requests": len(prompts),
            "coverage": coverage(ranks, top), "coverage_after_first_block": coverage(later, top),
            "not_ranked": round(sum(r < 0 for r in ranks) / max(1, len(ranks)), 4)}


def run(model: str, drafter: dict, gamma: int, suites, n: int, max_tokens: int, top: int, seed: int = 0) -> dict:
    from specula.runtime.bench.distributed import _make_drafter
    from specula.runtime.bench.spec import encoded_prompts
    from specula.runtime.engine.prompts import eos_ids
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    path = resolve(model)
    processor = load_processor(path)
    target = load_target(path)
    prompts = encoded_prompts(processor, suites, n, seed)
    r = measure(target, _make_drafter(drafter, str(path), target), prompts, gamma, max_tokens, top,
                eos_ids(processor.tokenizer, target))
    r["config"] = {"model": str(path), "drafter": drafter, "gamma": gamma, "suites": list(suites), "n_per_suite": n,
                   "max_tokens": max_tokens, "top": top, "seed": seed}
    return r


def render_markdown(r: dict) -> str:
    c = r["config"]
    lines = ["# Specula bench: verdict outcomes among the drafter's predicted outcomes", "",
             f"Model `{c['model']}`, drafter `{json.dumps(c['drafter'])}`, gamma {c['gamma']}, {c['n_per_suite']} "
             f"prompts per suite ({', '.join(c['suites'])}), max_tokens {c['max_tokens']}, greedy. "
             f"{r['blocks']} blocks followed by another of their request (each request's last block left out), "
             f"{r['first_blocks']} of them a request's first (never ready ahead).", "",
             "| top m outcomes (1 = the guess) | share of blocks | share of blocks after each request's first |",
             "| ---: | ---: | ---: |"]
    for m, v in r["coverage"].items():
        lines.append(f"| {m} | {v} | {r['coverage_after_first_block'][m]} |")
    lines += ["", f"Outcomes the drafter did not rank in its top {c['top']}: {r['not_ranked']} of blocks. "
              "No pipelining, however cheap its drafting, can have more blocks ready than the last row shows."]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    p.add_argument("--drafter", default="text_lm", help="a drafter that ranks rejection outcomes, kind or JSON "
                                                          "config (default: text_lm)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per block (default: 4)")
    p.add_argument("--top", type=int, default=12, help="outcomes ranked per block, the guess included (default: 12)")
    p.add_argument("--suite", action="append", default=[], help="evaluation suite, repeatable (default: all five)")
    p.add_argument("--n", type=int, default=6, help="prompts per suite (default: 6)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    p.add_argument("--out", default="reports/bench-outcomes", help="output directory for JSON + markdown")


def main(args) -> int:
    import torch

    torch.set_num_threads(1)
    if args.gamma < 1 or args.top < 1 or args.n < 1 or args.max_tokens < 1:
        raise SystemExit("--gamma, --top, --n and --max-tokens must be >= 1")
    drafter = json.loads(args.drafter) if args.drafter.strip().startswith("{") else {"kind": args.drafter}
    suites = tuple(args.suite) or ("caption", "vqa", "reasoning", "chart", "text")
    try:
        r = run(args.model, drafter, args.gamma, suites, args.n, args.max_tokens, args.top)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_outcomes.json").write_text(json.dumps(r, indent=1))
    md = render_markdown(r)
    (out / "bench_outcomes.md").write_text(md)
    print(md)
    print(f"wrote {out}")
    return 0
