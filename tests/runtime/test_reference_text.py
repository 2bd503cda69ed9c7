"""Every runtime against the committed reference text: the shipped target's plain greedy answers on a fixed prompt
set of every suite (tests/data/reference_greedy.json, built by ``specula bench reference``; runtime/bench/reference.py
says how its prompts were chosen). A change that alters the target's output fails here as a diff against that text,
not as two runtimes agreeing on the wrong answer.

Plain decoding reproduces every answer token for token (batch 1 and batched); greedy speculative decoding does too,
with every shipped drafter, as a chain and, where the registry builds one, as a tree, batched, with drafts both
accepted and rejected; the in-process application (LocalApp: ingress, vision, verifier, drafter over loopback
gRPC, the default config) returns the same text.
"""

from __future__ import annotations

import base64
import io
import json
from collections import Counter

import pytest
import torch

from specula.runtime.bench import reference as ref
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine

KINDS = ("ngram", "text_lm", "eagle", "msd", "flash", "aasd", "massv")  # the shipped drafters
GAMMA = 4
BATCH = 4
MIN_ACCEPTED = 10  # draft tokens accepted per drafter configuration over its prompts, at least


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def doc():
    return ref.load()


@pytest.fixture(scope="module")
def kit():
    target, processor, _ = ref.load_model("target")
    return target, processor


def params(doc) -> SamplingParams:
    return SamplingParams(max_tokens=doc["header"]["max_new_tokens"])


def one_per_suite(doc, k: int) -> list[dict]:
    """The k-th entry (cyclically) of every suite: 8 prompts, every suite once."""
    by_suite: dict[str, list[dict]] = {}
    for e in doc["prompts"]:
        by_suite.setdefault(e["suite"], []).append(e)
    return [es[k % len(es)] for es in by_suite.values()]


def decode(engine, reqs, batch: int) -> dict:
    out = {}
    for i in range(0, len(reqs), batch):
        out.update(engine.generate(reqs[i:i + batch]))
    return out


# --------------------------------------------------------------------------------------------- the file


def test_the_file_covers_every_suite_with_varied_multi_token_answers(doc):
    from specula.world.suites import SUITES

    counts = Counter(e["suite"] for e in doc["prompts"])
    assert set(counts) == set(SUITES) and min(counts.values()) >= 2
    texts = [e["text"] for e in doc["prompts"]]
    assert len(set(texts)) == len(texts) >= 20 and all(t.strip() for t in texts)
    lengths = [len(e["tokens"]) for e in doc["prompts"]]
    assert sum(n >= 10 for n in lengths) >= 8 and sum(n >= 3 for n in lengths) >= 10
    assert all(e["min_gap"] >= doc["header"]["tie_gap"] for e in doc["prompts"])  # no near tie was kept
    assert sum(e["images"] >= 2 for e in doc["prompts"]) >= 4 and any(e["images"] == 0 for e in doc["prompts"])


def test_the_file_is_of_the_shipped_target_and_the_worlds_prompts(doc, kit):
    from specula.zoo.store import MANIFEST

    shipped = json.loads(MANIFEST.read_text())["entries"]["target"]["files"]
    for name, sha in doc["header"]["fingerprint"].items():
        assert shipped[name]["sha256"] == sha, f"{name} changed: rebuild the reference (specula bench reference)"
    _, processor = kit
    for e, req in zip(doc["prompts"], ref.requests(processor, doc["prompts"], params(doc))):
        assert ref.sample_prompt(e["suite"], e["index"], e["seed"]).prompt == e["prompt"]
        assert req.input_ids.numel() == e["prompt_tokens"]


def test_the_file_is_written_as_read(doc):
    assert ref.dumps(doc) == ref.REFERENCE_FILE.read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------- runtimes


@pytest.mark.parametrize("batch", [1, BATCH])
def test_plain_decoding_reproduces_the_reference(kit, doc, batch):
    target, processor = kit
    engine = SpecEngine(target, None, gamma=0, eos_token_ids=[processor.tokenizer.eos_token_id])
    got = decode(engine, ref.requests(processor, doc["prompts"], params(doc)), batch)
    assert ref.diff(doc, {"header": doc["header"], "prompts": [
        {**e, "tokens": got[e["id"]].tokens} for e in doc["prompts"]]}, processor.tokenizer) == []


def _drafter_configs(kind: str, target, tokenizer):
    """The kind as a chain and, where the registry builds one, as a tree (the bench report's rule)."""
    from specula.runtime.bench.report.drafters import discover

    found = discover([{"kind": kind}, {"kind": kind, "structure": "tree"}], target, tokenizer)
    assert kind in [a.label for a in found.available], found.missing
    return found.available


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_greedy_reproduces_the_reference(kit, doc, kind):
    target, processor = kit
    tok = processor.tokenizer
    available = _drafter_configs(kind, target, tok)
    if kind == "eagle":
        assert [a.structure for a in available] == ["chain", "tree"]
    for j, a in enumerate(available):
        entries = one_per_suite(doc, KINDS.index(kind) + j)  # the tree gets the next prompt of each suite
        engine = SpecEngine(target, a.drafter, gamma=GAMMA, eos_token_ids=[tok.eos_token_id])
        got = decode(engine, ref.requests(processor, entries, params(doc)), BATCH)
        for e in entries:
            assert got[e["id"]].tokens == e["tokens"], ref.diff(
                {"header": doc["header"], "prompts": [e]},
                {"header": doc["header"], "prompts": [{**e, "tokens": got[e["id"]].tokens}]}, tok)
        drafted = sum(got[e["id"]].metrics.draft_tokens for e in entries)
        accepted = sum(got[e["id"]].metrics.accepted_tokens for e in entries)
        print(f"{a.label}: {len(entries)} prompts, {drafted} drafted, {accepted} accepted")
        assert accepted >= MIN_ACCEPTED, f"{a.label}: only {accepted} draft tokens accepted"
        assert drafted > accepted, f"{a.label}: no draft was rejected"


def _body(entry: dict, max_tokens: int) -> dict:
    """The POST /generate body of a reference prompt: its text and its images as base64 PNG."""
    images = []
    for im in ref.sample_prompt(entry["suite"], entry["index"], entry["seed"]).images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode())
    return {"prompt": entry["prompt"], "images": images, "max_tokens": max_tokens}


def test_local_app_with_the_default_config_returns_the_reference_text(doc):
    from specula.runtime.config import load_config
    from specula.runtime.serve import LocalApp

    entries = one_per_suite(doc, 1)
    with LocalApp.from_config(load_config({"drafter": {"kind": "eagle"}})) as app:
        for e in entries:
            got = app.generate(_body(e, doc["header"]["max_new_tokens"]))
            assert (got["text"], got["tokens"]) == (e["text"], e["tokens"]), e["id"]
            assert got["usage"]["prompt_tokens"] == e["prompt_tokens"] and got["drafter"] == "ok"
