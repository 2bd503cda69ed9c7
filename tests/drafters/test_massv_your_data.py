"""``specula train massv --target DIR --data FILE`` on the user's own target and conversations (issue 63), for both
stock layouts (tiny LLaVA-1.5 and Qwen2.5-VL checkpoints, ``tests/stock_checkpoints.py``): a few steps through the
CLI entry, the export loads back as a ``massv`` drafter (by its directory, as ``specula serve --drafter DIR`` does)
whose greedy output equals plain decoding on the file's prompts, images included; the SDViT data are the target's
own answers to the file's image prompts (Qwen's image grid carried to its vision tower); ``--answers data`` trains
phase 2 on the file's answers; a bad file and an LM of another tokenizer fail before training, named."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from specula.cli import main
from specula.drafters import create
from specula.drafters.text_lm import _own_tokenizer
from specula.drafters.vocab import check_vocab
from specula.runtime.config_front_door import drafter_from_ref
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.targets import PrefillRequest, load_target
from specula.targets.processor import load_processor
from specula.training.data.sources import ConversationSource
from specula.training.drafters import massv as tm
from specula.training.drafters.distill_data import load_answers
from specula.zoo.store import TOKENIZER_DIR, ZOO_DIR, weights_fingerprint

LAYOUTS = ["llava15_dir", "qwen25vl_dir"]
SMALL = ["--arch", "tiny", "--pretrain-samples", "6", "--samples", "6", "--data-samples", "4",
         "--max-new-tokens", "6", "--threads", "1"]


def train_argv(target_dir, data, run, out, *extra) -> list[str]:
    return ["train", "massv", "--target", str(target_dir), "--data", str(data), "--run-dir", str(run),
            "--out", str(out), "--export", *SMALL, *extra]


@pytest.fixture(scope="module", params=LAYOUTS)
def trained(request, tmp_path_factory, conversations_file):
    """One CLI run per layout with the default --init-lm (the embedded text_lm: another tokenizer, so a fresh tiny
    LM over the target's vocabulary); (target dir, run dir, export dir, printed log)."""
    target_dir = request.getfixturevalue(request.param)
    base = tmp_path_factory.mktemp("massv-yours")
    buf = io.StringIO()  # module scope has no capsys
    with contextlib.redirect_stdout(buf):
        assert main(train_argv(target_dir, conversations_file, base / "run", base / "out")) == 0
    return target_dir, base / "run", base / "out", buf.getvalue()


def file_requests(processor, data, params) -> list:
    """Requests of the file's prompts: three with images (one with two) and one text-only."""
    src = ConversationSource(data, None, processor, progress=False)
    prompts = [src.get("vision", i).prompt for i in (0, 1, 2)] + [src.get("text", 0).prompt]
    assert prompts[2].pixel_values is not None and prompts[3].pixel_values is None
    return [p.request(f"r{i}", params) for i, p in enumerate(prompts)]


def test_export_drafts_losslessly_for_the_users_target(trained, conversations_file):
    target_dir, run, out, log = trained
    assert "does not speak this target's tokenizer" in log and "fresh --arch tiny LM" in log  # the default LM fell back
    assert "using all 1" in log  # the file holds 1 held-out prompt: eval_samples capped, logged
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "massv" and info["target_sha256"] == weights_fingerprint(target_dir)
    assert info["init_lm"] is None and info["data_file"] == str(conversations_file)
    processor = load_processor(target_dir)
    saved = _own_tokenizer(out)  # the tokenizer beside the model, as the drafter reads it: the target's
    assert saved.get_vocab() == processor.tokenizer.get_vocab()
    assert drafter_from_ref(str(out)) == {"kind": "massv", "options": {"path": str(out)}}

    target = load_target(target_dir)
    assert check_vocab("massv", target.info.vocab_size, target.info.vocab_size, saved, processor.tokenizer).identity
    drafter = create({"kind": "massv", "path": str(out)}, target=target, tokenizer=processor)
    assert drafter.spec.needs == {"pre_projector"}
    assert drafter.massv.config.feature_dim == tm.feature_dim(target, "pre_projector")
    eos = eos_ids(processor.tokenizer, target)
    params = SamplingParams(max_tokens=8)
    plain = SpecEngine(target, None, eos_token_ids=eos).generate(file_requests(processor, conversations_file, params))
    got = SpecEngine(target, drafter, gamma=3, eos_token_ids=eos).generate(
        file_requests(processor, conversations_file, params))
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in plain.items()}
    assert sum(r.metrics.draft_tokens for r in got.values()) > 0  # it drafted, images included

    with pytest.raises(ValueError, match="tokenizer"):  # a massv export refuses a target of another tokenizer
        create({"kind": "massv", "path": str(out)}, target=target, tokenizer=load_processor(TOKENIZER_DIR))


def test_sdvit_data_are_the_targets_answers_to_the_files_image_prompts(trained, conversations_file):
    target_dir, run, _out, _log = trained
    processor = load_processor(target_dir)
    answers = load_answers(run / "data", "vision", 4)
    assert [a.index for a in answers] == [0, 1, 2, 3]  # the file's prompts count from 0
    src = ConversationSource(conversations_file, None, processor, progress=False)
    first = src.get("vision", 0).prompt
    assert torch.equal(answers[0].prompt, first.input_ids)
    target = load_target(target_dir)  # prompt 0 is sampled at temperature 0: the target's greedy answer
    ref = target.generate_plain([PrefillRequest("g", first.input_ids, first.pixel_values, first.image_grid_thw)], 6,
                                eos_ids(processor.tokenizer, target))[0]
    assert answers[0].response.tolist() == ref
    state = json.loads((run / "ckpt" / "state.json").read_text())
    assert state["samples"] == 12 and state["phase"] == 2 and state["history"]


def test_answers_data_trains_phase_2_on_the_files_answers(tmp_path, qwen25vl_dir, conversations_file, monkeypatch):
    seen = []
    real = tm.losses
    monkeypatch.setattr(tm, "losses", lambda model, target, items, *a: seen.extend(items) or real(model, target,
                                                                                                 items, *a))
    assert main(train_argv(qwen25vl_dir, conversations_file, tmp_path / "run", tmp_path / "out",
                           "--answers", "data", "--init-lm", "none")) == 0
    assert not list((tmp_path / "run" / "data").glob("vision-*"))  # the target answered no training prompt
    src = ConversationSource(conversations_file, None, load_processor(qwen25vl_dir), progress=False)
    theirs = {tuple(src.get("vision", i).answer_ids[:6].tolist()) for i in range(4)}
    assert len(seen) == 12 and all(tuple(it.response.tolist()) in theirs for it in seen)
    assert json.loads((tmp_path / "out" / "specula.json").read_text())["answers"] == "data"


def test_bad_file_and_foreign_lm_fail_before_training(tmp_path, llava15_dir, conversations_file, capsys):
    data = tmp_path / "data"
    shutil.copytree(conversations_file.parent, data)
    (data / "images" / "004.png").unlink()  # record r4's image
    assert main(train_argv(llava15_dir, data / conversations_file.name, tmp_path / "run", tmp_path / "out")) != 0
    err = capsys.readouterr().err
    assert "r4" in err and "004.png" in err
    assert not (tmp_path / "run" / "ckpt").exists() and not (tmp_path / "run" / "data").exists()

    assert main(train_argv(llava15_dir, conversations_file, tmp_path / "run2", tmp_path / "out2", "--init-lm",
                           str(ZOO_DIR / "text_lm"))) != 0
    err = capsys.readouterr().err
    assert "--init-lm none --arch tiny" in err and "tokenizer" in err
    assert not (tmp_path / "run2" / "ckpt").exists()


def test_resumes_exactly_and_starts_from_an_lm_of_the_targets_tokenizer(tmp_path, qwen25vl_dir, conversations_file):
    """A file run's sample order is a pure function of the counter (text_every mixes the file's text-only prompts);
    an LM saved with the target's tokenizer (here the first run's export) is taken as --init-lm, untouched by
    phase 1."""
    from dataclasses import replace

    from safetensors.torch import load_file
    from trainer_kit import assert_resumes_exactly

    from specula.drafters.massv_model import MassvModel

    cfg = tm.MassvTrainConfig(run_dir=str(tmp_path / "a"), target=str(qwen25vl_dir), data_file=str(conversations_file),
                              init_lm=None, arch="tiny", pretrain_total=4, sdvit_total=8, data_samples=4, text_every=2,
                              eval_samples=1, max_new_tokens=6, caption_max_tokens=6, chunk=2, gen_batch=4, pool=4,
                              warmup_samples=1, ckpt_every_s=1e9, eval_every_s=1e9)
    ckpt, _ = assert_resumes_exactly(tm.train, cfg, replace(cfg, run_dir=str(tmp_path / "b")), stop_at=8,
                                     weights="model.safetensors")
    image = load_target(qwen25vl_dir).info.image_token_id
    texts = load_answers(tmp_path / "a" / "data", "text", 2)
    assert len(texts) == 2 and all(not (a.prompt == image).any() for a in texts)
    out = tm.export_massv(ckpt, tmp_path / "out")

    logs: list[str] = []
    again = tm.train(replace(cfg, run_dir=str(tmp_path / "c"), init_lm=str(out), text_every=0), log=logs.append,
                     stop_at=4)
    assert not any("fresh" in m for m in logs)
    assert json.loads((again / "state.json").read_text())["init_lm"] == str(out)
    start = MassvModel.load(out, torch.float32).lm.state_dict()
    after = load_file(again / "model.safetensors")
    shared = [k for k in start if f"lm.{k}" in after]
    assert len(shared) > 5 and all(torch.equal(after[f"lm.{k}"], start[k]) for k in shared)  # LM frozen
