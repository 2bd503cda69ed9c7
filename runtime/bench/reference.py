"""``specula bench reference``: the shipped target's plain greedy answers on a fixed prompt set, locked in a file.

Every runtime is tested against ``tests/data/reference_greedy.json`` (tests/runtime/test_reference_text.py), so a
change that alters the target's output shows up as a diff against committed text, not as two runtimes agreeing on
the wrong answer. The file changes only when the shipped target (its weights, config or tokenizer: the header's
fingerprint) or the world's prompts change; then it is rebuilt and the diff is reviewed like code.

How the prompt set is chosen (``select``), per evaluation suite, from the seeded samples
``generate(suite, "eval", OFFSET + i, SEED)`` for i < SCAN, each decoded plainly (SpecEngine, no drafter, batch 1,
greedy, at most MAX_NEW_TOKENS tokens):

- a prompt is dropped when at any step of its answer the target's top-2 logit gap is below TIE_GAP (a near tie,
  where rounding differences between runtimes may legitimately pick the other token);
- a prompt is dropped when its answer decodes to empty text, or to a text already kept for the suite;
- of those left, the PER_SUITE with the longest answers (in tokens; the lower index on equal length) are kept.

    specula bench reference                 # rebuild the file (about a minute on two cores)
    specula bench reference --check         # decode the file's prompts again; a readable diff, exit 1 if any
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: runtime/bench/ is two folders below it
REFERENCE_FILE = ROOT / "tests" / "data" / "reference_greedy.json"
OFFSET = 50_000  # evaluation-split indices of the reference set (the benches use 30_000.., the gates 20_000..)
SEED = 0
SCAN = 24  # candidates per suite
PER_SUITE = 3
MAX_NEW_TOKENS = 32
TIE_GAP = 1e-4  # top-2 logit gap below which a step is a near tie
FINGERPRINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # what decides the target's output


class GapRecorder:
    """Wraps a Target for a plain SpecEngine: the smallest top-2 logit gap of the logits behind each request's
    emitted tokens (prefill: the first token; every decode step: the next)."""

    def __init__(self, target) -> None:
        self.target = target
        self.gaps: dict[str, float] = {}

    def __getattr__(self, name):
        return getattr(self.target, name)

    def _record(self, request_ids, logits) -> None:
        top = logits.topk(2, -1).values  # [B, 2]
        for rid, gap in zip(request_ids, (top[:, 0] - top[:, 1]).tolist()):
            self.gaps[rid] = min(self.gaps.get(rid, float("inf")), gap)

    def prefill(self, requests):
        out = self.target.prefill(requests)
        self._record(out.request_ids, out.logits)  # [B, V]
        return out

    def decode_step(self, request_ids):
        out = self.target.decode_step(request_ids)
        self._record(request_ids, out.logits[:, 0])  # [B, 1, V] -> [B, V]
        return out


def sample_prompt(suite: str, index: int, seed: int = SEED):
    """The world sample behind a reference entry."""
    from specula.world import generate

    return generate(suite, "eval", index, seed)


def requests(processor, entries, params) -> list:
    """The entries' prompts as GenerationRequests (request id = entry id), encoded as ``specula generate`` and the
    benches encode them."""
    from specula.runtime.engine.prompts import encode_prompt

    out = []
    for e in entries:
        s = sample_prompt(e["suite"], e["index"], e["seed"])
        out.append(encode_prompt(processor, s.prompt, s.images).request(e["id"], params))  # the checkpoint's template
    return out


def decode_plain(target, processor, entries, max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict]:
    """Plain greedy answers of ``entries`` (dicts with suite, index, seed), one request at a time: each entry
    completed with its prompt, image count, tokens, text, finish reason and smallest top-2 logit gap."""
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import SpecEngine

    tok = processor.tokenizer
    recorder = GapRecorder(target)
    engine = SpecEngine(recorder, None, gamma=0, eos_token_ids=[tok.eos_token_id])
    params = SamplingParams(max_tokens=max_new_tokens)
    out = []
    for e in entries:
        e = {"id": f"{e['suite']}-{e['index']}", "suite": e["suite"], "index": e["index"], "seed": e["seed"]}
        (req,) = requests(processor, [e], params)
        res = engine.generate([req])[e["id"]]
        s = sample_prompt(e["suite"], e["index"], e["seed"])  # the prompt as the world wrote it
        out.append({**e, "prompt": s.prompt, "images": len(s.images), "prompt_tokens": int(req.input_ids.numel()),
                    "tokens": res.tokens, "text": tok.decode(res.tokens, skip_special_tokens=True),
                    "finish_reason": res.finish_reason, "min_gap": recorder.gaps.pop(e["id"])})
    return out


def select(target, processor, suites=None) -> list[dict]:
    """The reference prompts with their answers, chosen by the rule in the module docstring (default: every
    evaluation suite)."""
    from specula.world.suites import SUITES

    chosen = []
    for suite in suites or list(SUITES):
        cands = decode_plain(target, processor, [{"suite": suite, "index": OFFSET + i, "seed": SEED}
                                                 for i in range(SCAN)])
        seen, keep = set(), []
        for c in cands:
            if c["min_gap"] >= TIE_GAP and c["text"].strip() and c["text"] not in seen:
                seen.add(c["text"])
                keep.append(c)
        if len(keep) < PER_SUITE:
            raise RuntimeError(f"suite {suite}: only {len(keep)} of {SCAN} candidates qualify, {PER_SUITE} needed")
        longest = sorted(keep, key=lambda c: (-len(c["tokens"]), c["index"]))[:PER_SUITE]
        chosen += sorted(longest, key=lambda c: c["index"])
    return chosen


def fingerprint(model_dir: Path) -> dict[str, str]:
    """sha256 of the checkpoint files that decide the target's output."""
    from specula.zoo.store import sha256

    return {name: sha256(model_dir / name) for name in FINGERPRINT_FILES if (model_dir / name).is_file()}


def build(model: str = "target") -> dict:
    """The reference document for ``model`` (a zoo entry or a checkpoint directory)."""
    target, processor, path = load_model(model)
    header = {"model": model, "fingerprint": fingerprint(path), "dtype": str(target.info.dtype),
              "max_new_tokens": MAX_NEW_TOKENS, "decoding": "greedy, plain SpecEngine (no drafter), batch 1",
              "offset": OFFSET, "seed": SEED, "scan": SCAN, "per_suite": PER_SUITE, "tie_gap": TIE_GAP,
              "regenerate": "specula bench reference"}
    return {"header": header, "prompts": select(target, processor)}


def load(path: str | Path = REFERENCE_FILE) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def dumps(doc: dict) -> str:
    """JSON with one field per line and each token list on one line, so a changed answer is a short diff."""
    marks = {}
    prompts = []
    for e in doc["prompts"]:
        marks[f"@tokens:{e['id']}"] = json.dumps(e["tokens"])
        prompts.append({**e, "tokens": f"@tokens:{e['id']}", "min_gap": round(e["min_gap"], 4)})
    text = json.dumps({**doc, "prompts": prompts}, indent=1, ensure_ascii=False)
    for mark, tokens in marks.items():
        text = text.replace(json.dumps(mark), tokens)
    return text + "\n"


def diff(expected: dict, got: dict, tokenizer) -> list[str]:
    """Readable differences between two reference documents (empty: they agree)."""
    out = []
    for name in sorted(set(expected["header"]["fingerprint"]) | set(got["header"]["fingerprint"])):
        a, b = expected["header"]["fingerprint"].get(name), got["header"]["fingerprint"].get(name)
        if a != b:
            out.append(f"target file {name}: sha256 {a} in the reference, {b} now (the target changed)")
    now = {e["id"]: e for e in got["prompts"]}
    for e in expected["prompts"]:
        g = now.get(e["id"])
        if g is None:
            out.append(f"{e['id']}: not decoded")
        elif g["prompt"] != e["prompt"]:
            out.append(f"{e['id']}: the world's prompt changed\n  reference: {e['prompt']!r}\n  now:       "
                       f"{g['prompt']!r}")
        elif g["tokens"] != e["tokens"]:
            out.append(_token_diff(e, g, tokenizer))
    return out


def _token_diff(e: dict, g: dict, tokenizer) -> str:
    a, b = e["tokens"], g["tokens"]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    same = tokenizer.decode(a[:k], skip_special_tokens=True)
    return (f"{e['id']}: answers part at token {k} (of {len(a)} in the reference, {len(b)} now)\n"
            f"  prompt:    {e['prompt']!r}\n  common:    {same!r}\n"
            f"  reference: ...{tokenizer.decode(a[k:], skip_special_tokens=True)!r}  ids {a[k:k + 6]}\n"
            f"  now:       ...{tokenizer.decode(b[k:], skip_special_tokens=True)!r}  ids {b[k:k + 6]}")


def load_model(model: str = "target"):
    """(target, processor, checkpoint directory) of a zoo entry or a local checkpoint."""
    from transformers.utils import logging as hf_logging

    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    hf_logging.disable_progress_bar()
    path = resolve(model)
    return load_target(str(path)), load_processor(path), path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    p.add_argument("--out", default=None,
                   help="the reference file (default: tests/data/reference_greedy.json in the checkout)")
    p.add_argument("--check", action="store_true",
                   help="decode the file's prompts again and print a diff per prompt that differs (exit 1 if any); "
                        "the file is not written")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")


def main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else REFERENCE_FILE
    if not args.check:
        doc = build(args.model)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(doc), encoding="utf-8")
        n = len(doc["prompts"])
        print(f"wrote {out}: {n} prompts, {len({e['text'] for e in doc['prompts']})} distinct answers")
        return 0
    if not out.is_file():
        print(f"no reference file at {out} (build it with: specula bench reference)")
        return 1
    expected = load(out)
    target, processor, path = load_model(args.model)
    got = {"header": {"fingerprint": fingerprint(path)},
           "prompts": decode_plain(target, processor, expected["prompts"], expected["header"]["max_new_tokens"])}
    problems = diff(expected, got, processor.tokenizer)
    for p in problems:
        print(p)
    print(f"{len(expected['prompts'])} prompts: {'all match' if not problems else f'{len(problems)} differences'} "
          f"({out})")
    return 1 if problems else 0
