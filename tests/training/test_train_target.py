"""The target training recipe on a tiny model: losses fall, checkpoints resume, export loads with from_pretrained."""

import json
import random

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from specula.targets.processor import load_processor
from specula.world import generate
from specula.training.target.batching import Encoder, collate, token_budget_batches
from specula.training.build import export
from specula.zoo.store import verify
from specula.training.target.quality import greedy_answer
from specula.training.target.train import TrainConfig, train
from specula.training.target.vision_heads import patch_loss


def test_labels_cover_only_the_assistant_turn(processor):
    enc = Encoder(processor)
    s = generate("vqa", "eval", 3)
    e = enc.encode(s)
    labelled = e.labels[e.labels != -100]
    assert processor.tokenizer.decode(labelled, skip_special_tokens=True) == s.response
    assert (e.input_ids == processor.tokenizer.convert_tokens_to_ids("<image>")).sum() == 144
    assert e.patch_targets.shape == (1, 144, 5) and (e.patch_targets >= 0).any()
    assert e.patch_classes.shape == (1, 144, 3) and (e.patch_classes[..., 1] >= 0).any()


def test_token_budget_batches_respect_budget(processor):
    enc = Encoder(processor)
    items = [enc.encode(generate(n, "eval", i)) for n in ("text", "vqa", "video") for i in range(4)]
    groups = token_budget_batches(items, 2048)
    assert sum(len(g) for g in groups) == len(items)
    for g in groups:
        assert len(g) == 1 or max(len(e.input_ids) for e in g) * len(g) <= 2048
    b = collate(groups[0], processor.tokenizer.pad_token_id)
    assert b.input_ids.shape == b.attention_mask.shape == b.labels.shape


def test_patch_loss_prefers_the_patch_words():
    targets = torch.full((1, 3, 2), -1)
    targets[0, 0] = torch.tensor([4, 7])
    targets[0, 1, 0] = 2
    good = torch.full((1, 3, 10), -5.0)
    good[0, 0, [4, 7]] = 5.0
    good[0, 1, 2] = 5.0
    bad = torch.zeros((1, 3, 10))
    assert patch_loss(good, targets) < 0.75 < patch_loss(bad, targets)
    assert patch_loss(bad, torch.full((1, 3, 2), -1)) == 0


@pytest.mark.slow
def test_train_resume_and_export(tmp_path, processor):
    # --stop-at ends the run early (with a checkpoint) on the schedule of the whole run
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=144, stop_at=96, pool=48,
                      token_budget=2048, warmup_samples=10, eval_n=4, eval_every_s=1e9, ckpt_every_s=1e9, threads=1,
                      vision_images=64)
    logs = []
    ckpt = train(cfg, processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert 96 <= state["samples"] < 144 and state["history"] and "vqa_exact_blank_image" in state["history"][-1]
    assert "multi_image_exact_blank_image" in state["history"][-1]  # image sets tracked against blank images too
    assert "vqa_exact_lead" in state["history"][-1]  # and VQA with a line of text before the image
    # a longer run over the same directory resumes instead of starting over (here with weighted object-cell openers)
    cfg2 = TrainConfig(**{**cfg.__dict__, "stop_at": 0, "object_cell_weight": 2.0})
    train(cfg2, processor, log=logs.append)
    assert any("resumed" in m for m in logs)
    state2 = json.loads((ckpt / "state.json").read_text())
    assert state2["samples"] >= 144 and state2["steps"] > state["steps"]
    out = export(ckpt, tmp_path / "zoo" / "target")
    assert not verify(tmp_path / "zoo")
    model = LlavaForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    answer = greedy_answer(model, load_processor(out), generate("vqa", "eval", 0), max_new_tokens=4)
    assert isinstance(answer, str)
    # the CLI stages a candidate outside the shipped zoo (drafters then train on it with --target)
    from specula.cli import main

    assert main(["zoo", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "next" / "target")]) == 0
    assert not verify(tmp_path / "next") and (tmp_path / "next" / "target" / "model.safetensors").exists()


@pytest.mark.slow
def test_zoo_build_regenerates_deterministically(tmp_path, capsys):
    """`specula zoo build` (training/recipe.py at tiny arch and scale: every target stage, then every drafter) twice from
    scratch gives identical files; a rerun of a finished build skips every step and changes nothing."""
    from specula.cli import main
    from specula.zoo.store import scan
    from specula.training.recipe import DRAFTERS, SHIPPED_UNTIL, stages_until

    def build(k: int) -> dict:
        zoo = tmp_path / f"zoo{k}"
        zoo.mkdir(exist_ok=True)
        assert main(["zoo", "build", "--zoo-dir", str(zoo), "--run-dir", str(tmp_path / f"runs{k}"), "--arch", "tiny",
                     "--scale", "0.0005", "--tokenizer-samples", "200", "--threads", "1"]) == 0
        assert not verify(zoo)
        return {n: {f: v["sha256"] for f, v in e["files"].items() if f != "specula.json"}
                for n, e in scan(zoo)["entries"].items()}

    first = build(0)
    assert set(first) == {"tokenizer", "target"} | {d.name for d in DRAFTERS}
    for d in DRAFTERS:  # records name their zoo's entries, so that a staged zoo can move (runs/zoo-next -> zoo/weights)
        info = json.loads((tmp_path / "zoo0" / d.name / "specula.json").read_text())
        refs = {info.get(k) for k in ("target", "distilled_from", "init_lm")} - {None}
        assert "target" in refs and refs <= {"target", "text_lm"}, (d.name, refs)
    capsys.readouterr()
    assert build(1) == first
    assert build(0) == first  # resumed: nothing retrained
    out = capsys.readouterr().out
    assert all(f"target stage {st.name}: done" in out for st in stages_until(SHIPPED_UNTIL))
    assert all(f"drafter {d.name}: done" in out for d in DRAFTERS)
    # --drafters-only over the same run directory: no tokenizer or target step, every drafter already done
    assert main(["zoo", "build", "--zoo-dir", str(tmp_path / "zoo0"), "--run-dir", str(tmp_path / "runs0"), "--arch",
                 "tiny", "--scale", "0.0005", "--threads", "1", "--drafters-only"]) == 0
    out = capsys.readouterr().out
    assert "target stage" not in out and "tokenizer" not in out and "export the target" not in out
    assert all(f"/{len(DRAFTERS)}] drafter {d.name}: done" in out for d in DRAFTERS)
    # the run directory lost (a new session): drafters exported for this target are read off the zoo, not retrained;
    # one exported for another target (here: a changed record) is trained again
    info = json.loads((tmp_path / "zoo0" / "eagle" / "specula.json").read_text())
    (tmp_path / "zoo0" / "eagle" / "specula.json").write_text(json.dumps({**info, "target_sha256": "0" * 64}))
    assert main(["zoo", "build", "--zoo-dir", str(tmp_path / "zoo0"), "--run-dir", str(tmp_path / "lost"), "--arch",
                 "tiny", "--scale", "0.0005", "--threads", "1", "--drafters-only"]) == 0
    out = capsys.readouterr().out
    assert all(f"drafter {d.name}: done (exported in the zoo for this target)" in out for d in DRAFTERS
               if d.name != "eagle")
    assert "drafter eagle: specula train eagle" in out
    assert json.loads((tmp_path / "zoo0" / "eagle" / "specula.json").read_text())["target_sha256"] == info["target_sha256"]
    state = json.loads((tmp_path / "runs0" / "target" / "ckpt" / "state.json").read_text())
    assert state["lm_from"] and state["samples"] >= 4 and state["code_lm_done"]  # merged, then the joint stage


def test_zoo_build_dry_run_prints_the_recipe(capsys):
    from specula.cli import main
    from specula.training.recipe import SHIPPED_UNTIL, TARGET_STAGES

    assert main(["zoo", "build", "--dry-run", "--run-dir", "r"]) == 0
    out = capsys.readouterr().out
    assert '"code_lm_stop": 22944' in out and '"vision_images": 180000' in out and '"tower_lr_mult": 0.05' in out
    assert "specula train massv" in out and "--init-lm" in out
    shipped = [st.name for st in TARGET_STAGES][: [st.name for st in TARGET_STAGES].index(SHIPPED_UNTIL) + 1]
    assert all(f"target stage {name} " in out for name in shipped)  # the shipped target's stages
    assert '"stop_at": 55008' in out  # the second cycle's cut, where the shipped target was taken
    assert '"from": "r/direct/ckpt"' in out and '"init_from": "r/target/ckpt"' in out and '"stop_at": 24864' in out
    # --until an earlier stage stops there (joint: the first word-code target shipped); --drafters-only: drafters
    assert main(["zoo", "build", "--dry-run", "--run-dir", "r", "--until", "joint"]) == 0
    out = capsys.readouterr().out
    assert "target stage joint " in out and "target stage captions" not in out
    assert main(["zoo", "build", "--dry-run", "--run-dir", "r", "--drafters-only"]) == 0
    out = capsys.readouterr().out
    assert "target stage" not in out and "specula train eagle" in out
    assert main(["zoo", "build", "--dry-run", "--until", "no-such-stage"]) == 2
    assert "no target stage 'no-such-stage'" in capsys.readouterr().err


def test_zoo_build_drafters_only_needs_a_target_in_the_zoo(tmp_path, capsys):
    from specula.cli import main

    assert main(["zoo", "build", "--drafters-only", "--zoo-dir", str(tmp_path), "--run-dir", str(tmp_path / "r")]) == 2
    assert "has none" in capsys.readouterr().err
    assert main(["zoo", "build", "--drafters-only", "--skip-drafters", "--dry-run"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["zoo", "build", "--dry-run", "--run-dir", "r", "--drafters-only", "--drafter", "msd",
                 "--drafter", "eagle"]) == 0  # a lane of a parallel drafter build: those two, in recipe order
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[2] for ln in lines] == ["eagle", "msd"]
    assert main(["zoo", "build", "--dry-run", "--drafters-only", "--drafter", "medusa"]) == 2
    assert "not in the recipe" in capsys.readouterr().err


@pytest.mark.slow
def test_zoo_build_until_the_last_stage_builds_the_direct_route(tmp_path):
    """`--until` the recipe's last stage (tiny arch and scale, no drafters): the caption stage starts from the joint
    stage's checkpoint rounded to fp16, the refit stage copies it into its own run with a cell-code projector, the
    suite stages go on there, the second cycle restarts from that run in its own, the image-set stages from that one
    (numbered images, the set terms without their hops at this size), the finishing stage from theirs and on into
    counting, the counting run from that with the tower's chart-word legs, the readout run from that, and the last
    run is what the build exports."""
    from specula.cli import main
    from specula.training.recipe import TARGET_STAGES, scaled

    zoo, runs = tmp_path / "zoo", tmp_path / "runs"
    assert main(["zoo", "build", "--zoo-dir", str(zoo), "--run-dir", str(runs), "--arch", "tiny", "--scale",
                 "0.0005", "--tokenizer-samples", "200", "--threads", "1", "--skip-drafters",
                 "--until", TARGET_STAGES[-1].name]) == 0
    joint = json.loads((runs / "target" / "ckpt" / "state.json").read_text())
    direct = json.loads((runs / "direct" / "ckpt" / "state.json").read_text())
    cells = json.loads((runs / "cells" / "ckpt" / "state.json").read_text())
    assert direct["warm_restart_at"] == joint["samples"] and direct["samples"] >= joint["samples"]
    refit = cells["projector_refits"][-1]
    assert refit["cell_codes"] == 1.0 and refit["from"] == str(runs / "direct" / "ckpt")
    assert refit["at_samples"] == direct["samples"] and cells["samples"] >= scaled(40_000, 0.0005)
    cycle2 = json.loads((runs / "cycle2" / "ckpt" / "state.json").read_text())  # the second cycle: a warm restart
    assert cycle2["warm_restart_at"] == cells["samples"] and cycle2["samples"] >= scaled(55_008, 0.0005)
    assert cycle2["samples"] > cells["samples"]  # it trains (at this scale 20 -> 28), not only copies the weights
    reader = json.loads((runs / "reader" / "ckpt" / "state.json").read_text())  # the image-set stages, one run
    assert reader["warm_restart_at"] == cycle2["samples"] and reader["samples"] >= scaled(63_456, 0.0005)
    assert reader["config"]["number_images"] and reader["config"]["mix"] == "scan_multi_odd"
    assert reader["config"]["set_consistency"] == 30.0 and reader["config"]["set_count"] == 0  # no hops at tiny size
    finish = json.loads((runs / "finish" / "ckpt" / "state.json").read_text())  # the finishing stage, then counting
    assert finish["warm_restart_at"] == reader["samples"] and finish["samples"] >= scaled(80_448, 0.0005)
    count = json.loads((runs / "count" / "ckpt" / "state.json").read_text())  # the counting and chart-word stages
    assert count["warm_restart_at"] == finish["samples"] and count["samples"] >= scaled(105_984, 0.0005)
    assert count["vision_images_done"] == scaled(305_000, 0.0005)  # the tower's four chart-word legs
    assert count["projector_fit"]["at_samples"] == count["vision_stage_at"] >= scaled(93_696, 0.0005)
    readout = json.loads((runs / "readout" / "ckpt" / "state.json").read_text())
    assert readout["warm_restart_at"] == count["samples"] and readout["samples"] >= scaled(145_056, 0.0005)
    assert readout["config"]["chart_words"] == "whole" and readout["config"]["mix"] == "scan_suites_charts"
    assert readout["config"]["chart_readout"] == 0  # a hop term: off at tiny size
    info = json.loads((zoo / "target" / "specula.json").read_text())
    assert info["trained_samples"] == readout["samples"] and not verify(zoo)
    assert json.loads((zoo / "target" / "processor_config.json").read_text())["number_images"]


def test_init_from_a_training_checkpoint_rounds_its_weights_to_fp16(tmp_path, processor):
    from safetensors.torch import save_file

    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.train import _load_init_weights

    src = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1)
    (tmp_path / "ckpt").mkdir()
    sd = {k: v.contiguous() for k, v in src.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, tmp_path / "ckpt" / "model.safetensors")
    (tmp_path / "ckpt" / "state.json").write_text(json.dumps({"samples": 96, "elapsed_s": 120.0, "history": [{}]}))
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=2)
    info = _load_init_weights(model, tmp_path / "ckpt")
    assert info == {"trained_samples": 96, "train_minutes": 2.0, "history": [{}]}
    got = model.state_dict()
    assert all(torch.equal(got[k], v.half().float()) for k, v in sd.items())
    assert any(not torch.equal(got[k], v) for k, v in sd.items())  # rounded, not copied
    with pytest.raises(FileNotFoundError, match="neither"):
        _load_init_weights(model, tmp_path)


def test_code_lm_stop_cuts_the_stage_on_its_schedule(tmp_path, processor):
    """A stopped code stage keeps its schedule and stays unfinished; the next run (more layers) goes on from it."""
    base = dict(arch="tiny", total_samples=0, pool=4, token_budget=2048, warmup_samples=4, eval_n=1,
                eval_every_s=1e9, ckpt_every_s=1e9, threads=1, code_lm_samples=16, code_token_budget=2048,
                vision_images=0)
    with pytest.raises(ValueError, match="code_lm_stop"):
        TrainConfig(**base, code_lm_stop=16)
    quiet = lambda m: None  # noqa: E731
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "a"), code_lm_layers=1, code_lm_stop=8, **base), processor,
                 log=quiet)
    state = json.loads((ckpt / "state.json").read_text())
    assert 8 <= state["code_lm_samples"] < 16 and not state.get("code_lm_done")
    assert (ckpt / "code_optimizer.pt").exists() and "code_lm_grown_from" not in state
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "a"), code_lm_layers=2, **base), processor, log=quiet)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["code_lm_samples"] >= 16 and state["code_lm_done"]


@pytest.mark.slow
def test_training_continues_from_exported_weights(tmp_path, processor):
    cfg = TrainConfig(run_dir=str(tmp_path / "a"), arch="tiny", total_samples=48, pool=48, token_budget=2048,
                      warmup_samples=10, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9, threads=1,
                      vision_images=32)
    out = export(train(cfg, processor, log=lambda m: None), tmp_path / "zoo" / "target")
    logs = []
    cfg2 = TrainConfig(**{**cfg.__dict__, "run_dir": str(tmp_path / "b"), "total_samples": 96, "init_from": str(out)})
    ckpt = train(cfg2, processor, log=logs.append)
    assert any("initialised from" in m for m in logs)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] >= 96 and state["warm_restart_at"] >= 48


def test_max_minutes_stops_the_joint_stage_with_a_checkpoint_that_resumes(tmp_path, processor):
    cfg = TrainConfig(run_dir=str(tmp_path / "a"), arch="tiny", total_samples=96, pool=16, token_budget=2048,
                      warmup_samples=10, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9, threads=1,
                      vision_images=16, max_minutes=1e-6)
    logs = []
    ckpt = train(cfg, processor, log=logs.append)
    stopped = json.loads((ckpt / "state.json").read_text())["samples"]
    assert 16 <= stopped < 96 and any("--max-minutes" in m for m in logs)  # one pool, then the time is up
    ckpt = train(TrainConfig(**{**cfg.__dict__, "max_minutes": 0.0}), processor, log=lambda m: None)
    assert json.loads((ckpt / "state.json").read_text())["samples"] >= 96  # a rerun goes on to the end


def test_set_consistency_takes_part_in_the_joint_stage(tmp_path, processor):
    """The set-consistency term reaches the step: the same run with and without it ends with other weights (and a
    rerun without it with the same ones, so the difference is its), and the check logs it."""
    from safetensors.torch import load_file

    base = dict(arch="tiny", total_samples=16, pool=16, token_budget=2048, warmup_samples=4, eval_n=2,
                eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=16, mix="scan_placed_multi")
    quiet = lambda m: None  # noqa: E731
    weights, history = {}, {}
    for name, sets in (("plain", 0.0), ("again", 0.0), ("sets", 1.0)):
        ckpt = train(TrainConfig(run_dir=str(tmp_path / name), set_consistency=sets, **base), processor, log=quiet)
        weights[name] = load_file(ckpt / "model.safetensors")
        history[name] = json.loads((ckpt / "state.json").read_text())["history"]
    lm = [k for k in weights["plain"] if "language_model.layers.0." in k]
    assert all(torch.equal(weights["plain"][k], weights["again"][k]) for k in lm)
    assert any(not torch.equal(weights["plain"][k], weights["sets"][k]) for k in lm)
    assert any(h.get("loss_set_consistency", 0) > 0 for h in history["sets"])
    assert not any("loss_set_consistency" in h for h in history["plain"])


def test_train_config_checks_device_and_max_minutes():
    with pytest.raises(ValueError, match="device must be"):
        TrainConfig(run_dir="x", device="gpu0")
    with pytest.raises(ValueError, match="max_minutes"):
        TrainConfig(run_dir="x", max_minutes=-1)
    assert TrainConfig(run_dir="x", device="cuda:1").device == "cuda:1"


def test_batch_to_moves_every_tensor(processor):
    from specula.training.target.batching import batch_to

    enc = Encoder(processor)
    b = collate([enc.encode(generate("vqa", "eval", i)) for i in range(2)], processor.tokenizer.pad_token_id)
    assert batch_to(b, "cpu") is b  # already there
    meta = batch_to(b, "meta")
    assert meta.input_ids.is_meta and meta.pixel_values.is_meta and meta.patch_targets.is_meta
    assert meta.n_samples == b.n_samples and meta.input_ids.shape == b.input_ids.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash .ci/device_check.sh)")
def test_joint_stage_trains_on_cuda_and_checkpoints_on_the_cpu(tmp_path, processor):
    cfg = TrainConfig(run_dir=str(tmp_path / "a"), arch="tiny", total_samples=64, pool=16, token_budget=2048,
                      warmup_samples=10, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9, threads=1,
                      vision_images=16, device="cuda")
    logs = []
    ckpt = train(cfg, processor, log=logs.append)
    assert any("joint stage on cuda" in m for m in logs)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] >= 64 and state["history"][-1]["vqa_exact"] >= 0.0
    # and a CPU run resumes the CUDA checkpoint (moments included)
    ckpt = train(TrainConfig(**{**cfg.__dict__, "device": "cpu", "total_samples": 96}), processor, log=lambda m: None)
    assert json.loads((ckpt / "state.json").read_text())["samples"] >= 96


@pytest.mark.slow
def test_exported_word_code_target_continues_with_its_joint_stage_only(tmp_path, processor):
    """--init-from with the word-code flags: the exported weights are past the code LM, vision and fit stages, so
    none of them runs again (the code stage would overwrite the LM, the fit the projector); the joint stage goes on."""
    base = dict(arch="tiny", pool=8, token_budget=2048, warmup_samples=4, eval_n=4, eval_every_s=1e9,
                ckpt_every_s=1e9, threads=1, code_lm_samples=8, code_lm_layers=1, code_token_budget=2048,
                vision_images=8, projector_fit_images=8, freeze_projector=True)
    quiet = lambda m: None  # noqa: E731
    out = export(train(TrainConfig(run_dir=str(tmp_path / "a"), total_samples=8, **base), processor, log=quiet),
                 tmp_path / "zoo" / "target")
    exported = LlavaForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).state_dict()
    logs = []
    cfg = TrainConfig(run_dir=str(tmp_path / "b"), total_samples=24, init_from=str(out), vis_weight=0.0, **base)
    ckpt = train(cfg, processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["code_lm_done"] and state["vision_images_done"] == 8 and state["projector_fit"] == {"from": str(out)}
    assert not any(h.get("stage") == "code_lm" for h in state["history"][-1:])  # no code stage ran here
    assert not any("projector fit" in m.lower() or "vision stage" in m.lower() for m in logs), logs
    assert state["samples"] >= 24 and state["warm_restart_at"] >= 8
    assert "caption_attribute_recall" in state["history"][-1]  # the training check reads captions too
    from safetensors.torch import load_file

    after = load_file(ckpt / "model.safetensors")
    proj = [k for k in after if k.startswith("model.multi_modal_projector.")]
    assert proj and all(torch.equal(after[k], exported[k]) for k in proj)  # the fitted projector is kept
    assert any(not torch.equal(after[k], exported[k]) for k in after if ".language_model." in k)  # the LM trained


@pytest.mark.parametrize("entry", ["vqa_dialogue", "text_scene_dialogue", "chart_dialogue", "multi_dialogue",
                                   "video_dialogue"])
def test_dialogue_labels_cover_every_assistant_turn(processor, entry):
    from specula.world.suites import MIXES

    enc = Encoder(processor)
    maker = {m[0]: m[1] for m in MIXES["scan_suites"]}[entry]
    s = maker(random.Random("dialogue-test"), "vqa", "vqa")
    assert ("<image>" in s.prompt) == (entry != "text_scene_dialogue") and s.followups and len(s.followups) <= 11
    assert len({q for q, _ in s.followups} | {s.prompt}) == len(s.followups) + 1  # distinct questions
    e = enc.encode(s)
    tok = processor.tokenizer
    eos = tok.eos_token_id
    # the labelled tokens are exactly each answer followed by EOS, in order
    labelled = e.labels[e.labels != -100].tolist()
    answers = [s.response] + [a for _, a in s.followups]
    expected = []
    for a in answers:
        expected += tok(a, add_special_tokens=False).input_ids + [eos]  # Metaspace: same tokens as in context
    assert labelled == expected
    # the text is what the chat template makes of the same messages (one image mark in the first user turn)
    msgs = [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.response}]
    for q, a in s.followups:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    templ = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    image_id = tok.convert_tokens_to_ids("<image>")
    assert [t for t in e.input_ids.tolist() if t != image_id] == [t for t in templ if t != image_id]


def test_single_turn_labels_unchanged_by_dialogue_support(processor):
    from specula.training.target.batching import assistant_labels

    ids = torch.tensor([1, 4, 9, 5, 7, 8, 2])  # bos user x assistant a b eos
    out = assistant_labels(ids, assistant_id=5, eos_id=2)
    assert out.tolist() == [-100, -100, -100, -100, 7, 8, 2]


def test_object_cell_weights_mark_each_object_cells_opening_word(processor):
    """In a scan caption the weight lands on the "a"/"an" after the comma of every cell holding an object (as many
    as the listing's object cells), nowhere in the prompt and not on "no object"; the weighted LM loss is the
    weighted mean of the per-label losses, and weight 1 leaves the loss as it was."""
    import dataclasses

    import torch.nn.functional as F

    from specula.world.suites import MIXES
    from specula.training.target.cell_weights import object_cell_weights, opener_ids
    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.train import forward_losses

    name, maker, task, _ = next(m for m in MIXES["scan_captions"] if m[0] == "caption")
    s = maker(random.Random(3), name, task)
    e = Encoder(processor).encode(s)
    batch = collate([e], processor.tokenizer.pad_token_id)
    comma, opens = opener_ids(processor.tokenizer)
    w = object_cell_weights(batch.input_ids, batch.labels, comma, opens, 3.0)  # [1, L]
    listing = s.response.split(".")[0]
    object_cells = 9 - listing.count("no object")
    assert 1 <= object_cells < 9
    marked = (w == 3.0).nonzero()[:, 1]
    assert len(marked) == object_cells and (w[w != 3.0] == 1.0).all()
    assert (batch.labels[0, marked] >= 0).all() and set(batch.input_ids[0, marked].tolist()) <= set(opens)
    assert (batch.input_ids[0, marked - 1] == comma).all()

    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    cfg = TrainConfig(arch="tiny")
    plain = forward_losses(model, batch, cfg)["lm"]
    same = forward_losses(model, dataclasses.replace(batch, label_weights=torch.ones_like(w)), cfg)["lm"]
    torch.testing.assert_close(same, plain)
    weighted = forward_losses(model, dataclasses.replace(batch, label_weights=w), cfg)["lm"]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, pixel_values=batch.pixel_values).logits[0, :-1]  # [L-1, V]
    tgt, ww = batch.labels[0, 1:], w[0, 1:]
    sel = tgt != -100
    ce = F.cross_entropy(logits[sel].float(), tgt[sel], reduction="none")
    torch.testing.assert_close(weighted, (ww[sel] * ce).sum() / ww[sel].sum(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="object_cell_weight"):
        TrainConfig(arch="tiny", object_cell_weight=0)
    with pytest.raises(ValueError, match="stop_at"):
        TrainConfig(arch="tiny", stop_at=-1)
