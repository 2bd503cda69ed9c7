"""``specula train target``: train the embedded LLaVA target from scratch on the world's training split.

Recipe (why each part is there is in zoo/TRAINING.md):
- one stage, all parameters trained, AdamW with warmup + cosine decay, projector at a higher learning rate;
- loss = cross-entropy on the assistant turn only
        + ``aux_in`` * dense patch loss on the projector outputs (through the LM's final norm and tied lm_head:
          each visual token must look like the words of the object under its patch, e.g. "▁red" + "▁circle")
        + ``aux_out`` * the same loss on the LM's last hidden state at visual positions;
  the dense loss makes visual tokens speak the LM's word space, so answering from the image becomes the same
  copy-from-context skill the text-only "described scene" questions teach;
- a curriculum: the first ``curriculum`` share of samples is drawn mostly from single-object questions and short
  captions, then the full mix;
- image-vs-blank accuracy on held-out VQA and image-set questions is logged every ``eval_every_s`` seconds;
- optionally (``code_lm_samples`` > 0) the word-code recipe (``training/target/code_stages.py``): first the LM alone learns the
  world with fixed word codes in place of the image tokens (optionally shallow, then grown), then the vision stage
  regresses tower + projector onto those codes, and the joint stage keeps that regression as ``aux_in``.

The settings, each with its default and help, are ``TrainConfig``'s (training/target/config.py).

Checkpoints (fp32 weights + optimizer + state) go to ``<run_dir>/ckpt`` every ``ckpt_every_s`` seconds; a new run
with the same ``run_dir`` resumes from there. The data stream is indexed, so a resumed run sees the same samples.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specula.world.placed import variant
from specula.world.suites import MIXES, generate
from specula.world.tokenizer import BOS, USER
from specula.training.target.batching import Encoder, batch_to, collate, token_budget_batches
from specula.training.target.cell_weights import object_cell_weights, opener_ids
from specula.training.target.chart_readout import READ_LAYER, chart_readout_loss, value_token_ids
from specula.training.target.code_stages import code_lm_stage, code_vision_loss
from specula.training.target.config import TrainConfig
from specula.training.target.projector_fit import fit_projector
from specula.training.target.quality import caption_attribute_recall, chance_level, short_answer_accuracy
from specula.training.target.referents import eager_attention, referent_attention_loss
from specula.training.target.set_consistency import set_consistency_loss
from specula.training.target.set_count import COUNT_LAYER, SUMMARY_LAYER, set_count_hops
from specula.training.target.set_count_fit import fit_count_keys
from specula.training.target.set_isolation import set_isolation_loss
from specula.training.target.set_readout import (count_readout_loss, head_inputs, readout_token_ids, set_readout_loss,
                                     summary_readout_loss)
from specula.training.target.set_referents import SET_HOPS, hops_in_use
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.vision_heads import VisionHeads, patch_loss, tower_features, vision_stage
from specula.training.target.word_codes import WordCodes


CURRICULUM_WEIGHTS = {"vqa_single": 5.0, "caption_short": 3.0, "text": 1.5, "vqa": 1.5}


def mix_weights(frac: float, cfg: TrainConfig) -> list[float]:
    mix = MIXES[cfg.mix]
    if frac < cfg.curriculum and cfg.mix == "base":
        return [CURRICULUM_WEIGHTS.get(name, 0.25 * w) for name, _, _, w in mix]
    return [w for _, _, _, w in mix]


def sample_at(i: int, frac: float, cfg: TrainConfig, mix: str | None = None):
    rng = random.Random(f"specula-mix/{cfg.seed}/{i}")
    mix = mix or cfg.mix
    weights = mix_weights(frac, cfg) if mix == cfg.mix else [w for _, _, _, w in MIXES[mix]]
    k = rng.choices(range(len(MIXES[mix])), weights=weights)[0]
    name, maker, task, _ = MIXES[mix][k]
    return maker(random.Random(f"specula-world/{cfg.seed}/train/{name}/{i}"), name, task)


def lr_at(samples: int, cfg: TrainConfig, warm_restart_at: int = 0) -> float:
    since = samples - warm_restart_at
    if warm_restart_at and since < cfg.warmup_samples // 4:  # fresh optimizer moments: short re-warmup
        return lr_at(samples, cfg) * max(since, 1) / (cfg.warmup_samples // 4)
    if samples < cfg.warmup_samples:
        return cfg.lr * max(samples, 1) / cfg.warmup_samples
    frac = min(1.0, (samples - cfg.warmup_samples) / max(1, cfg.total_samples - cfg.warmup_samples))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def forward_losses(model, batch, cfg: TrainConfig, heads=None, opening: torch.Tensor | None = None,
                   readout_ids: torch.Tensor | None = None,
                   value_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The stage's losses on one batch; ``opening``: the token ids that open a dialogue's user turn (``<s><|user|>``),
    needed by ``set_consistency``; ``readout_ids``: the tokens ``set_readout`` reads out (``readout_token_ids``);
    ``value_ids``: the answers ``chart_readout`` reads (``chart_readout.value_token_ids``)."""
    lm = model.model.language_model
    embeds = model.get_input_embeddings()(batch.input_ids)  # [B, L, H]
    img = feats = None
    if batch.pixel_values is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not cfg.freeze_vision):
            feats, img = tower_features(model, batch.pixel_values)  # [N_img, T, D_vis], [N_img, T, H]
        mask = (batch.input_ids == model.config.image_token_id).unsqueeze(-1)  # [B, L, 1]
        embeds = embeds.masked_scatter(mask, img.reshape(-1, img.shape[-1]).to(embeds.dtype))
    refs = (cfg.referent_attention > 0 or cfg.set_referents > 0 or cfg.set_marks > 0 or cfg.set_isolation > 0
            or cfg.set_odd > 0 or cfg.set_count > 0 or cfg.chart_referents > 0) and bool(batch.referents)
    sets = cfg.set_consistency > 0 and img is not None and batch.lone_images is not None
    readout = cfg.set_readout > 0 and bool(batch.referents)
    if readout and readout_ids is None:
        raise ValueError("set_readout needs readout_ids (training/target/set_readout.py readout_token_ids)")
    summaries = cfg.set_count_readout > 0 and bool(batch.referents)
    numbers = cfg.set_count_number_readout > 0 and bool(batch.referents)
    hop_layers = {SET_HOPS[cfg.set_hops].patch_layer} if readout else set()
    if summaries:
        hop_layers.add(SUMMARY_LAYER)
    if numbers:
        hop_layers.add(COUNT_LAYER)
    charts = cfg.chart_readout > 0 and bool(batch.referents)
    if charts:
        if value_ids is None:
            raise ValueError("chart_readout needs value_ids (training/target/chart_readout.py value_token_ids)")
        hop_layers.add(READ_LAYER)
    with eager_attention(lm, refs), head_inputs(lm, hop_layers) as got:
        out = lm(inputs_embeds=embeds, attention_mask=batch.attention_mask, output_attentions=refs,
                 output_hidden_states=sets)
    term = set_readout_loss(lm, model.lm_head, got, batch.referents, batch.labels, readout_ids) if readout else None
    summary_term = summary_readout_loss(lm, model.lm_head, got, batch.referents) if summaries else None
    number_term = count_readout_loss(lm, model.lm_head, got, batch.referents) if numbers else None
    chart_term = chart_readout_loss(lm, model.lm_head, got, batch.referents, batch.labels, value_ids) \
        if charts else None
    hidden = out.last_hidden_state  # [B, L, H]
    # next-token loss on the assistant turn only
    tgt = batch.labels[:, 1:]  # [B, L-1]
    sel = tgt != -100
    logits = model.lm_head(hidden[:, :-1][sel])  # [M, V]
    if batch.label_weights is None:
        losses = {"lm": F.cross_entropy(logits.float(), tgt[sel])}
    else:  # weighted mean over the answer's labels (object-cell openers, training/target/cell_weights.py)
        w = batch.label_weights[:, 1:][sel].to(logits.device)  # [M]
        losses = {"lm": (w * F.cross_entropy(logits.float(), tgt[sel], reduction="none")).sum() / w.sum()}
    if term is not None:
        losses["set_readout"] = term
    if summary_term is not None:
        losses["set_count_readout"] = summary_term
    if number_term is not None:
        losses["set_count_number_readout"] = number_term
    if chart_term is not None:
        losses["chart_readout"] = chart_term
    if sets:
        if opening is None:
            raise ValueError("set_consistency needs the opening token ids (<s><|user|>)")
        losses["set_consistency"] = set_consistency_loss(model, batch, img, out.hidden_states, opening,
                                                         layers=cfg.set_consistency_layers)
    if cfg.freeze_vision:  # the vision losses could only train the heads
        return _referent(losses, out, batch, refs, cfg)
    if img is not None and batch.patch_codes is not None:  # word-code recipe: the projector keeps producing the codes
        losses["aux_in"] = code_vision_loss(img, batch.patch_codes)
    elif img is not None and batch.patch_targets is not None:
        losses["aux_in"] = patch_loss(model.lm_head(lm.norm(img)).float(), batch.patch_targets)
    if img is not None and batch.patch_targets is not None and cfg.aux_out > 0:
        vis = hidden[mask.squeeze(-1)].reshape(img.shape)  # [N_img, T, H]
        losses["aux_out"] = patch_loss(model.lm_head(vis).float(), batch.patch_targets)
    if feats is not None and heads is not None and batch.patch_classes is not None:
        losses["vis"] = heads.loss(feats, batch.patch_classes)
    return _referent(losses, out, batch, refs, cfg)


def _referent(losses: dict, out, batch, refs: bool, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The attention losses whose weight is on (targets of a term that is off, e.g. the set targets that
    ``set_readout`` reads, cost nothing)."""
    if refs:
        for key, group, weight in (("referent", "scene", cfg.referent_attention),
                                   ("set_referent", "set", cfg.set_referents),
                                   ("set_mark", "set_mark", cfg.set_marks), ("set_odd", "set_odd", cfg.set_odd),
                                   ("set_count", "set_count", cfg.set_count),
                                   ("chart_referent", "chart", cfg.chart_referents)):
            ref = referent_attention_loss(out.attentions, batch.referents, group) if weight > 0 else None
            if ref is not None:
                losses[key] = ref
        iso = set_isolation_loss(out.attentions, batch.referents) if cfg.set_isolation > 0 else None
        if iso is not None:
            losses["set_isolation"] = iso
    return losses


def _param_groups(model, cfg: TrainConfig):
    proj = [p for n, p in model.named_parameters() if "multi_modal_projector" in n]
    tower = [p for n, p in model.named_parameters() if "vision_tower" in n] if cfg.tower_lr_mult != 1.0 else []
    own = {id(p) for p in proj + tower}
    rest = [p for p in model.parameters() if id(p) not in own]
    groups = [
        {"params": rest, "lr_mult": 1.0},
        {"params": proj, "lr_mult": cfg.projector_lr_mult},
    ]
    if tower:  # a group of its own only when its rate differs (older checkpoints have two groups)
        groups.append({"params": tower, "lr_mult": cfg.tower_lr_mult})
    return groups


def _eval(model, processor, cfg: TrainConfig) -> dict[str, float]:
    samples = [generate("vqa", "eval", 10_000 + i, cfg.seed) for i in range(cfg.eval_n)]
    captions = [generate("caption", "eval", 10_000 + i, cfg.seed) for i in range(max(1, cfg.eval_n // 4))]
    model.eval()
    described = [s for s in (generate("text", "eval", 10_000 + i, cfg.seed) for i in range(4 * cfg.eval_n))
                 if s.kind == "text/scene"][: cfg.eval_n]
    image_sets = [generate("multi_image", "eval", 10_000 + i, cfg.seed) for i in range(max(1, cfg.eval_n // 2))]
    res = {
        "vqa_exact": short_answer_accuracy(model, processor, samples),
        "vqa_exact_blank_image": short_answer_accuracy(model, processor, samples, blank=True),
        "chance": chance_level(samples),
        # the same lookup over a scene described in words: the LM's own skill, without the vision path
        "text_scene_exact": short_answer_accuracy(model, processor, described),
        "caption_attribute_recall": caption_attribute_recall(model, processor, captions),
        # image sets (2-5 images per question), the suite a one-image LM does not read: image vs blank here too
        "multi_image_exact": short_answer_accuracy(model, processor, image_sets),
        "multi_image_exact_blank_image": short_answer_accuracy(model, processor, image_sets, blank=True),
        # the VQA questions with a held-out line of text before the image (world/placed.py): a target that reads
        # an image only at the start of the prompt answers these at blank level
        "vqa_exact_lead": short_answer_accuracy(model, processor,
                                                [variant(s, "lead") for s in samples[: cfg.eval_n // 2]]),
    }
    model.train()
    return res


def _vision_from(model, heads, src: Path, cfg: TrainConfig, state: dict, log) -> None:
    """Start a fresh run's tower, projector and vision heads from another run's checkpoint ``src``; its vision
    images count as done. Word codes depend only on (seed, width), so a tower trained to regress another run's
    codes serves this run's LM as well, whatever that run's LM learnt."""
    info = json.loads((src / "state.json").read_text())
    _check_compatible("--vision-from", src, info, cfg)
    sd = load_file(src / "model.safetensors")
    vision = {k: v for k, v in sd.items() if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    if not vision:
        raise ValueError(f"--vision-from {src}: no vision tower in its model.safetensors")
    unexpected = model.load_state_dict(vision, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"--vision-from {src}: unexpected keys {unexpected[:3]}")
    if (src / "heads.safetensors").exists():
        load_heads(heads, src / "heads.safetensors", log)
    state["vision_images_done"] = int(info.get("vision_images_done", 0))
    if cfg.projector_fit_images and "projector_fit" in info:
        state["projector_fit"] = info["projector_fit"]  # the loaded projector is that fit: no refit
    state["vision_from"] = str(src)
    log(f"vision tower, projector and heads from {src} ({state['vision_images_done']} vision images"
        f"{', fitted projector' if 'projector_fit' in state else ''})")


def _check_compatible(flag: str, src: Path, info: dict, cfg: TrainConfig) -> None:
    other = info.get("config", {})
    if (other.get("seed"), other.get("arch")) != (cfg.seed, cfg.arch) or bool(other.get("code_lm_samples")) != cfg.uses_codes:
        raise ValueError(f"{flag} {src}: trained with seed {other.get('seed')}, arch {other.get('arch')!r}, "
                         f"codes {bool(other.get('code_lm_samples'))}; this run has seed {cfg.seed}, arch "
                         f"{cfg.arch!r}, codes {cfg.uses_codes}")


def _lm_from(model, src: Path, cfg: TrainConfig, state: dict, log) -> None:
    """Start a fresh run's language model from another word-code run's checkpoint ``src`` (everything but tower and
    projector), with its code-stage progress: a code LM trained once can be paired with any tower that regresses the
    same codes (``--vision-from``). Only a run whose joint stage has not begun can give its LM this way."""
    info = json.loads((src / "state.json").read_text())
    _check_compatible("--lm-from", src, info, cfg)
    if not info.get("code_lm_done") or int(info.get("samples", 0)):
        raise ValueError(f"--lm-from {src}: its code LM stage is not finished or its joint stage has begun "
                         f"(code_lm_done {bool(info.get('code_lm_done'))}, joint samples {info.get('samples', 0)})")
    sd = load_file(src / "model.safetensors")
    lm = {k: v for k, v in sd.items() if not k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    if not lm:
        raise ValueError(f"--lm-from {src}: no language model in its model.safetensors")
    unexpected = model.load_state_dict(lm, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"--lm-from {src}: unexpected keys {unexpected[:3]}")
    model.tie_weights()
    for key in ("code_lm_samples", "code_lm_done", "code_lm_grown_from"):
        if key in info:
            state[key] = info[key]
    state["history"] = [h for h in info.get("history", []) if h.get("stage") == "code_lm"]
    state["elapsed_s"] = float(info.get("elapsed_s", 0.0))  # the LM's training time so far (the tower's: its run)
    state["lm_from"] = str(src)
    log(f"language model from {src} ({state['code_lm_samples']} code LM samples)")


def load_heads(heads: VisionHeads, path: Path, log) -> None:
    """Load saved vision heads; a place head that the file lacks starts fresh, one that ``heads`` lacks is
    dropped (both said in the log)."""
    sd = load_file(path)
    if heads.place is None and any(k.startswith("place.") for k in sd):
        log("vision heads: the checkpoint's place head is not used (vision_place_weight 0)")
        sd = {k: v for k, v in sd.items() if not k.startswith("place.")}
    missing = heads.load_state_dict(sd, strict=False).missing_keys
    if any(not k.startswith("place.") for k in missing):
        raise ValueError(f"vision heads {path}: missing {missing}")
    if missing:
        log("vision heads: the place head starts fresh")


def _to_device(model, heads, optimizers, device: torch.device) -> None:
    """Move ``model`` and ``heads`` to ``device`` and the optimizers' saved moments after them (the parameters stay
    the same objects, so the optimizers keep pointing at them; ``load_state_dict`` casts moments to their devices)."""
    model.to(device)
    heads.to(device)
    for opt in optimizers:
        opt.load_state_dict(opt.state_dict())


def _print_now(msg: str) -> None:
    print(msg, flush=True)  # a run in the background logs to a file: evaluations must not wait in a buffer


def _load_init_weights(model, src: Path) -> dict:
    """Load ``--init-from`` weights into ``model``; returns the training facts (``trained_samples``,
    ``train_minutes``, ``history``) they carry.

    ``src`` is an exported model directory (fp16, ``specula.json``) or a training checkpoint (fp32
    ``model.safetensors`` + ``state.json``, as ``specula zoo build`` hands one stage's run to the next); a
    checkpoint's weights are rounded to fp16 first, so that both start from the same numbers as the export would.
    """
    if (src / "state.json").exists() and (src / "model.safetensors").exists():
        sd = {k: v.to(torch.float16).float() for k, v in load_file(src / "model.safetensors").items()}
        model.load_state_dict(sd, strict=False)
        model.tie_weights()
        st = json.loads((src / "state.json").read_text())
        return {"trained_samples": st.get("samples", 0), "train_minutes": st.get("elapsed_s", 0.0) / 60.0,
                "history": st.get("history", []), **({"count_key_fit": st["count_key_fit"]}
                                                      if "count_key_fit" in st else {})}
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"--init-from {src}: neither an exported model (config.json) nor a training "
                                "checkpoint (state.json + model.safetensors)")
    from transformers import LlavaForConditionalGeneration

    loaded = LlavaForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.tie_weights()
    return json.loads((src / "specula.json").read_text()) if (src / "specula.json").exists() else {}


def _check_hops_fit(model, cfg: TrainConfig) -> None:
    """Refuse a run whose set terms train or read a hop on a layer or head the LM does not have."""
    used = hops_in_use(SET_HOPS[cfg.set_hops], cfg.set_referents > 0, cfg.set_marks > 0, cfg.set_readout > 0,
                       cfg.set_odd > 0)
    if cfg.uses_count_targets:
        used.update(set_count_hops())
    if cfg.chart_referents > 0:
        from specula.training.target.chart_referents import NUMBER_HEAD, NUMBER_LAYER

        used["chart number"] = (NUMBER_LAYER, NUMBER_HEAD)
    layers, heads = model.config.text_config.num_hidden_layers, model.config.text_config.num_attention_heads
    flags = "--set-referents / --set-marks / --set-readout / --set-odd / --set-count / --chart-referents"
    for name, (layer, head) in used.items():
        hop = f"the {name} hop (training/target/chart_referents.py)" if name.startswith("chart") else \
            f"the {name} hop of --set-hops {cfg.set_hops} (training/target/set_referents.py)"
        if layer >= layers:
            raise ValueError(f"{flags} need an LM deeper than layer {layer} ({hop}); arch {cfg.arch!r} has "
                             f"{layers} layers")
        if head >= heads:
            raise ValueError(f"{flags}: {hop} sits on head {head}; arch {cfg.arch!r} has {heads} heads")


def train(cfg: TrainConfig, processor, log=_print_now) -> Path:
    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    processor = copy.copy(processor)  # the caller's processor keeps its own prompt form
    processor.number_images = cfg.number_images  # the checkpoint's state.json and the export say so too
    tok = processor.tokenizer
    openers = opener_ids(tok)
    opening = torch.tensor(tok(BOS + USER, add_special_tokens=False).input_ids)  # [2] <s><|user|>
    model = build_model(TargetArch.from_name(cfg.arch), tok, seed=cfg.seed)
    _check_hops_fit(model, cfg)
    opt = torch.optim.AdamW(_param_groups(model, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg)}
    if (ckpt / "state.json").exists():
        model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
        model.tie_weights()
        saved = torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu")
        state = json.loads((ckpt / "state.json").read_text())
        if len(saved["param_groups"]) == len(opt.param_groups):
            opt.load_state_dict(saved)
        elif state.get("samples", 0):  # moments of a joint stage under way belong to its groups
            raise ValueError(f"{ckpt}: its joint stage ran with {len(saved['param_groups'])} parameter groups, this "
                             f"config has {len(opt.param_groups)} (--tower-lr-mult changed mid-stage?)")
        log(f"resumed from {ckpt}: {state['samples']} samples, {state['elapsed_s'] / 60:.1f} min")
    elif cfg.init_from:
        # continue from exported (fp16) weights when the run directory is gone: optimizer moments restart
        src = Path(cfg.init_from)
        info = _load_init_weights(model, src)
        state["samples"] = int(info.get("trained_samples", 0))
        state["elapsed_s"] = 60.0 * float(info.get("train_minutes", 0.0))
        state["history"] = list(info.get("history", []))
        state["warm_restart_at"] = state["samples"]
        if "count_key_fit" in info:  # those weights carry their count fit: a lane goes on with it, not refitted
            state["count_key_fit"] = info["count_key_fit"]
        if cfg.uses_codes:  # exported weights are past the code LM, vision and fit stages: only the joint stage runs
            state.update(code_lm_samples=cfg.code_lm_samples, code_lm_done=True, vision_images_done=cfg.vision_images,
                         vision_stage_at=0)
            if cfg.code_lm_layers:
                state["code_lm_grown_from"] = cfg.code_lm_layers
            if cfg.projector_fit_images:
                state["projector_fit"] = {"from": str(src)}  # the exported projector is the fit: no refit
        log(f"initialised from {src}: {state['samples']} samples already trained (optimizer restarts"
            f"{'; the vision heads start fresh' if cfg.vis_weight else ''})")
    # this run's prompt form and hop layers, also when it resumed from another run's checkpoint
    state["config"].update(number_images=cfg.number_images, set_hops=cfg.set_hops)
    codes = WordCodes(model.config.text_config.hidden_size, cfg.seed) if cfg.uses_codes else None
    enc = Encoder(processor, codes=codes, referents=cfg.referent_attention > 0, sets=cfg.set_consistency > 0,
                  set_referents=cfg.set_referents > 0 or cfg.set_readout > 0, set_marks=cfg.set_marks > 0,
                  set_hops=cfg.set_hops, set_isolation=cfg.set_isolation > 0, set_odd=cfg.set_odd > 0,
                  chart_referents=cfg.chart_referents > 0, chart_words=cfg.chart_words, set_count=cfg.uses_count_targets)
    readout_ids = readout_token_ids(enc.word_id) if cfg.set_readout > 0 else None
    value_ids = value_token_ids(enc.word_id) if cfg.chart_readout > 0 else None
    heads = VisionHeads(model.config.vision_config.hidden_size, place_weight=cfg.vision_place_weight)
    if cfg.lm_from and not (ckpt / "state.json").exists():
        _lm_from(model, Path(cfg.lm_from), cfg, state, log)
    if cfg.vision_from and not (ckpt / "state.json").exists():
        _vision_from(model, heads, Path(cfg.vision_from), cfg, state, log)
    heads_opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if (ckpt / "heads.safetensors").exists():
        load_heads(heads, ckpt / "heads.safetensors", log)
        if (ckpt / "heads_optimizer.pt").exists():
            try:
                heads_opt.load_state_dict(torch.load(ckpt / "heads_optimizer.pt", weights_only=True,
                                                     map_location="cpu"))
            except ValueError:  # the place head was added or dropped since: the moments do not map
                log("vision heads: the saved optimizer has other heads; its moments restart")
    model.train()

    def save(extra: dict | None = None) -> None:
        """Checkpoint model, optimizers and state; ``extra`` (name -> state dict) adds a stage's own optimizer."""
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        tmp.mkdir(exist_ok=True)
        for name, sd_extra in (extra or {}).items():
            torch.save(sd_extra, tmp / f"{name}.pt")
        sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(sd, tmp / "model.safetensors")
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}, tmp / "heads.safetensors")
        torch.save(heads_opt.state_dict(), tmp / "heads_optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        for f in tmp.iterdir():
            f.replace(ckpt / f.name)
        tmp.rmdir()

    # raising --code-lm-samples on a resumed run extends the code stage (before the joint stage has begun)
    extend = state.get("code_lm_samples", 0) < cfg.code_lm_samples and state.get("samples", 0) == 0
    if cfg.uses_codes and (not state.get("code_lm_done") or extend):
        if (ckpt / "code_optimizer.pt").exists():
            state["_code_opt_state"] = torch.load(ckpt / "code_optimizer.pt", weights_only=True, map_location="cpu")
        eval_samples = [generate("vqa", "eval", 10_000 + i, cfg.seed) for i in range(cfg.eval_n)]
        code_lm_stage(model, enc, codes, cfg, state, save,
                      lambda i, frac: sample_at(i, frac, cfg, mix=cfg.code_lm_mix), eval_samples, log=log)
        if not state.get("code_lm_done"):  # cut short (code_lm_stop): a later run with another config goes on
            log(f"code LM stage stopped at {state['code_lm_samples']} of {cfg.code_lm_samples} samples")
            return ckpt
        (ckpt / "code_optimizer.pt").unlink(missing_ok=True)
    # the vision stage runs until ``vision_images`` images are done; raising it on a resumed run extends the stage
    vision_done = state.get("vision_images_done", cfg.vision_images if "vision_stage_at" in state else 0)
    vision_ran = cfg.vision_images > vision_done
    if vision_ran:
        def vision_checkpoint(done: int, opt_sd: dict) -> None:
            state["vision_images_done"] = done  # mid-stage: a resumed run continues the stage from here
            save({"vision_optimizer": opt_sd})

        vis_opt = ckpt / "vision_optimizer.pt"
        vision_stage(model, heads, enc, cfg.vision_images - vision_done, cfg.seed, lr=cfg.vision_lr or cfg.lr, log=log,
                     start=vision_done, checkpoint=vision_checkpoint, ckpt_every_s=cfg.ckpt_every_s,
                     opt_state=torch.load(vis_opt, weights_only=True, map_location="cpu") if vis_opt.exists() else None,
                     pos_lr_mult=cfg.vision_pos_lr_mult,
                     train_projector=not (cfg.projector_fit_images and "projector_fit" in state))
        state["vision_stage_at"] = state["samples"]  # 0 for a fresh run; later when added to a running recipe
        state["vision_images_done"] = cfg.vision_images
        save()
        vis_opt.unlink(missing_ok=True)  # a later extension of the stage starts with fresh moments
    # the fit follows the vision stage: once, and again whenever a resumed run extended the stage
    if cfg.projector_fit_images and ("projector_fit" not in state or vision_ran):  # training/target/projector_fit.py
        fit = fit_projector(model, enc, cfg.projector_fit_images, cfg.seed, gate_background=cfg.projector_fit_gate,
                            log=log)
        state["projector_fit"] = {**asdict(fit), "at_samples": state["samples"]}
        save()
    if cfg.set_count_key_fit and "count_key_fit" not in state:  # once per run (training/target/set_count_fit.py)
        kfit = fit_count_keys(model, enc, cfg.set_count_key_fit, cfg.seed, log=log,
                              query_steps=cfg.set_count_query_steps)
        state["count_key_fit"] = {**asdict(kfit), "at_samples": state["samples"]}
        save()
    if cfg.freeze_vision:  # no gradient reaches them, so AdamW leaves them (and their weight decay) alone
        for n, p in model.named_parameters():
            if n.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                p.requires_grad_(False)
    elif cfg.freeze_projector:  # the LM's gradient still reaches the tower, through the fixed projector
        for n, p in model.named_parameters():
            if n.startswith("model.multi_modal_projector."):
                p.requires_grad_(False)
    if cfg.device != "cpu":  # the joint stage on the accelerator: the model, the heads and both optimizers' moments
        _to_device(model, heads, (opt, heads_opt), torch.device(cfg.device))
        log(f"joint stage on {cfg.device}")
    bar = tqdm(total=cfg.total_samples, initial=state["samples"], unit="sample", desc="train target", mininterval=5.0)
    t_start = time.time()
    t_last = time.time()
    last_ckpt = last_eval = time.time()
    ema: dict[str, float] = {}
    end = min(cfg.total_samples, cfg.stop_at) if cfg.stop_at else cfg.total_samples
    while state["samples"] < end:
        frac = state["samples"] / cfg.total_samples
        start = state["samples"]
        items = [enc.encode(sample_at(start + j, frac, cfg)) for j in range(cfg.pool)]
        for group in token_budget_batches(items, cfg.token_budget):
            batch = collate(group, tok.pad_token_id)
            if cfg.object_cell_weight != 1.0:
                batch = replace(batch, label_weights=object_cell_weights(
                    batch.input_ids, batch.labels, *openers, cfg.object_cell_weight))
            batch = batch_to(batch, model.device)
            lr = lr_at(state["samples"], cfg, state.get("warm_restart_at", 0))
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_mult"]
            losses = forward_losses(model, batch, cfg, heads, opening, readout_ids, value_ids)
            loss = losses["lm"] + cfg.aux_in * losses.get("aux_in", 0.0) + cfg.aux_out * losses.get("aux_out", 0.0) \
                + cfg.vis_weight * losses.get("vis", 0.0) \
                + cfg.referent_attention * losses.get("referent", 0.0) \
                + cfg.set_consistency * losses.get("set_consistency", 0.0) \
                + cfg.set_referents * losses.get("set_referent", 0.0) \
                + cfg.set_marks * losses.get("set_mark", 0.0) + cfg.set_readout * losses.get("set_readout", 0.0) \
                + cfg.set_isolation * losses.get("set_isolation", 0.0) + cfg.set_odd * losses.get("set_odd", 0.0) \
                + cfg.set_count * losses.get("set_count", 0.0) \
                + cfg.chart_referents * losses.get("chart_referent", 0.0) \
                + cfg.chart_readout * losses.get("chart_readout", 0.0) \
                + cfg.set_count_readout * losses.get("set_count_readout", 0.0) \
                + cfg.set_count_number_readout * losses.get("set_count_number_readout", 0.0)
            opt.zero_grad(set_to_none=True)
            heads_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            heads_opt.step()
            state["steps"] += 1
            state["samples"] += batch.n_samples
            bar.update(batch.n_samples)
            for k, v in losses.items():
                x = float(v.detach())
                ema[k] = 0.98 * ema.get(k, x) + 0.02 * x
        now = time.time()
        state["elapsed_s"] += now - t_last
        t_last = now
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if now - last_eval > cfg.eval_every_s:
            res = _eval(model, processor, cfg)
            res.update(samples=state["samples"], minutes=round(state["elapsed_s"] / 60, 1), **{f"loss_{k}": round(v, 4) for k, v in ema.items()})
            state["history"].append(res)
            log(json.dumps(res))
            last_eval = t_last = time.time()
        if now - last_ckpt > cfg.ckpt_every_s:
            save()
            last_ckpt = time.time()
        if cfg.max_minutes and time.time() - t_start > 60.0 * cfg.max_minutes:
            log(f"stopping at {state['samples']} samples: --max-minutes {cfg.max_minutes:g} reached")
            break
    bar.close()
    res = _eval(model, processor, cfg)
    res.update(samples=state["samples"], minutes=round(state["elapsed_s"] / 60, 1))
    state["history"].append(res)
    log(json.dumps(res))
    save()
    return ckpt
