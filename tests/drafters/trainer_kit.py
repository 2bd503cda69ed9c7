"""The scaffolding the drafter training tests share: a lively tiny target saved to a temporary directory, the
interrupted-then-resumed run that must equal an uninterrupted one, the loss that must fall, the fp16 export that
must load back, and the exported drafter that must keep plain decoding's output.

A uniquely named module, so test files import it directly (``from conftest import`` resolves to whichever
conftest.py pytest loaded last, which depends on collection order)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from drafter_kit import lively_target
from safetensors.torch import load_file

from specula.training.drafters.distill_data import pixels
from specula.training.drafters.eagle import evaluate
from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR, ZOO_DIR


def save_lively_target(tmp_path_factory, name: str) -> Path:
    """``drafter_kit.lively_target`` (answers vary instead of repeating one token) saved under a fresh temporary
    directory ``name`` with the embedded tokenizer, chat template and processor (zoo/weights/tokenizer): returns its ``target``
    folder."""
    import shutil

    model = lively_target(load_processor(TOKENIZER_DIR))
    d = tmp_path_factory.mktemp(name) / "target"
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        shutil.copy(TOKENIZER_DIR / f, d / f)  # its tokenizer and processor beside it, as a checkpoint has them
    return d


def assert_resumes_exactly(train, cfg, straight_cfg, stop_at: int,
                           weights: str = "head.safetensors") -> tuple[Path, dict]:
    """Trains ``cfg`` to ``stop_at`` samples (an interrupted run), then resumes it to the end; an uninterrupted run
    of ``straight_cfg`` must end with the very same weights (same batches, same noise, same steps). Returns the
    resumed run's checkpoint and its weights."""
    logs: list[str] = []
    ckpt = train(cfg, log=logs.append, stop_at=stop_at)
    assert json.loads((ckpt / "state.json").read_text())["samples"] == stop_at
    train(cfg, log=logs.append)  # resumes
    assert any("resumed from" in m for m in logs) and any("already in" in m for m in logs)
    straight = train(straight_cfg, log=lambda m: None)
    a, b = load_file(ckpt / weights), load_file(straight / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return ckpt, a


def assert_loss_falls(head, trained: dict, target, processor, answers, cfg, **kw) -> None:
    """``head`` at its init scores worse on ``answers`` than with the ``trained`` weights (loaded into it)."""
    before = evaluate(head, target, processor, answers, cfg, **kw)
    head.load_state_dict(trained)
    after = evaluate(head, target, processor, answers, cfg, **kw)
    assert after["eval_feat"] < 0.9 * before["eval_feat"] and after["eval_hard"] < before["eval_hard"]


def assert_export_loads(out: Path, kind: str, load, target, trained: dict) -> tuple[dict, torch.nn.Module]:
    """An exported head folder ``out``: exactly its fp16 weights, config and specula.json (no zoo manifest next to
    it); it loads back with the target (lm_head shared) close to the ``trained`` weights, and without the target
    with the same logits. Returns specula.json and the head loaded with the target."""
    assert sorted(p.name for p in out.iterdir()) == [f"{kind}.safetensors", f"{kind}_config.json", "specula.json"]
    assert not (out.parent / "manifest.json").exists()  # only the real zoo's manifest is rewritten
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == kind
    assert all(v.dtype == torch.float16 for v in load_file(out / f"{kind}.safetensors").values())
    assert (out / f"{kind}.safetensors").stat().st_size < 2 * 1.1 * info["params"]
    loaded = load(out, target)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, trained[k], atol=2e-3, rtol=2e-3)
    assert loaded._shared[1] is target.model.get_output_embeddings()
    alone = load(out)  # no target in the process: frozen copies read from the target's checkpoint
    x = torch.randn(3, loaded.config.hidden_size)
    torch.testing.assert_close(alone.logits(x), loaded.logits(x))
    return info, loaded


def answer_requests(processor, answers, seed: int, max_tokens: int = 8) -> list[GenerationRequest]:
    """The prompts of cached answers (images as the recipe renders them) as greedy requests r0, r1, .."""
    return [GenerationRequest(f"r{i}", x.prompt, pixels(processor, x, seed), SamplingParams(max_tokens=max_tokens))
            for i, x in enumerate(answers)]


def assert_drafts_like_plain(target_dir, target, drafter, reqs, gamma: int, eos: list[int]) -> None:
    """Speculative decoding with ``drafter`` on ``target`` emits what plain decoding of a fresh target emits."""
    ref = SpecEngine(load_target(target_dir), None, eos_token_ids=eos).generate(reqs)
    got = SpecEngine(target, drafter, gamma=gamma, eos_token_ids=eos).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in ref.items()}


def zoo_listing() -> list[str]:
    """What the real zoo holds now (a CLI test must leave it as it was)."""
    return sorted(p.name for p in ZOO_DIR.iterdir()) if ZOO_DIR.is_dir() else []
