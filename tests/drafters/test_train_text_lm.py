"""The text_lm training recipe on tiny models: target answers cached and resumable, training resumes, the export
loads as a drafter that keeps greedy output equal to plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from drafter_kit import world_requests
from safetensors import safe_open
from safetensors.torch import load_file
from trainer_kit import assert_drafts_like_plain, save_lively_target

from specula.drafters import create
from specula.training.drafters.text_lm import (
    TextLMTrainConfig,
    export_text_lm,
    greedy_tau,
    target_fingerprint,
    train,
)
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import verify, write as write_manifest
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "target")


def small(tmp_path, target_dir, **kw) -> TextLMTrainConfig:
    base = dict(run_dir=str(tmp_path / "run"), target=str(target_dir), arch="tiny", data_samples=24, eval_samples=8,
                max_new_tokens=6, chunk=8, gen_batch=4, total_samples=48, pool=16, token_budget=1024,
                warmup_samples=8, lr=1e-2)
    return TextLMTrainConfig(**{**base, **kw})


def test_train_resumes_exports_and_reloads(tmp_path, target_dir):
    logs: list[str] = []
    cfg = small(tmp_path, target_dir, data_samples=20)  # the last chunk holds 4
    ckpt = train(cfg, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] >= 48 and "eval_tau_g4" in state["history"][-1]
    data = tmp_path / "run" / "data"
    assert sorted(f.name for f in data.glob("*.safetensors")) == [
        "eval.safetensors", "train-00000000.safetensors", "train-00000008.safetensors", "train-00000016.safetensors"]
    chunk = data / "train-00000008.safetensors"
    before = load_file(chunk)
    chunk.unlink()  # an interrupted data run: the rerun makes only what is missing, identically
    train(small(tmp_path, target_dir, total_samples=96), log=logs.append)  # 24 samples: the last chunk grows
    assert any("resumed" in m for m in logs) and any("8 of 24 target answers" in m for m in logs)
    after = load_file(chunk)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    state2 = json.loads((ckpt / "state.json").read_text())
    assert len(load_file(data / "train-00000016.safetensors")["index"]) == 8
    assert state2["samples"] >= 96 and state2["steps"] > state["steps"]
    assert state2["history"][-1]["eval_ce"] < state2["history"][0]["eval_ce"]  # it learns
    assert torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]

    out = export_text_lm(ckpt, tmp_path / "zoo" / "text_lm")
    assert not (tmp_path / "zoo" / "manifest.json").exists()  # only the real zoo's manifest is rewritten
    write_manifest(tmp_path / "zoo")
    assert not verify(tmp_path / "zoo")
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "text_lm" and info["image_token_id"] == 3 and info["trained_samples"] == state2["samples"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())

    # the export is a text_lm drafter: from a target (image token from it) or alone (from specula.json)
    assert create({"kind": "text_lm", "path": str(out)}).image_token_id == 3
    processor = load_processor(TOKENIZER_DIR)
    reqs = world_requests(processor, 3, SamplingParams(max_tokens=12), suites=["vqa", "text", "caption"])
    target = load_target(target_dir)
    drafter = create({"kind": "text_lm", "path": str(out), "structure": "tree"}, target=target)
    assert next(drafter.model.parameters()).dtype == torch.float32
    assert_drafts_like_plain(target_dir, target, drafter, reqs, 3, [-1])


def test_data_made_with_other_settings_is_refused(tmp_path, target_dir):
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    cfg = small(tmp_path, target_dir)
    (data / "meta.json").write_text(json.dumps({**cfg.data_key(), "target_sha256": target_fingerprint(target_dir),
                                                "topk": 4}))
    with pytest.raises(ValueError, match="another run_dir"):
        train(cfg, log=lambda m: None)


def test_bad_config_is_refused(tmp_path, target_dir):
    for bad, match in [({"arch": "huge"}, "arch"), ({"data_samples": 0}, "data_samples"), ({"topk": 0}, "topk"),
                       ({"kd_weight": 1.5}, "kd_weight"), ({"lr": 0.0}, "lr"), ({"seed": -1}, "seed"),
                       ({"chunk": 2.5}, "chunk"), ({"ckpt_every_s": 0}, "ckpt_every_s")]:
        with pytest.raises(ValueError, match=match):
            small(tmp_path, target_dir, **bad)


def test_greedy_tau_counts_like_the_engine():
    assert greedy_tau([True, True, False, True]) == (4, 2)
    assert greedy_tau([True] * 6, gamma=4) == (5, 1)  # 4 drafts accepted + the bonus token, in one block
    assert greedy_tau([False] * 4) == (3, 3)  # nothing accepted: one token per verification
    assert greedy_tau([True]) == (0, 0)  # the prefill's token only
