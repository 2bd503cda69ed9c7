"""``specula train massv``: MASSV's two-phase recipe (Ganesan et al. 2025, sec. 3), on the embedded world or on the
user's target and conversation file (``--target DIR --data FILE``).

Model (``drafters/massv_model.py``): a small Llama LM, initialised from the shipped text-only drafter (``init_lm``,
the paper's "existing small language model"; or fresh from ``arch``), plus a new randomly initialised MLP
projector over the *target's* vision features (``feature``: pre-projector by default). The target (vision tower
included) is frozen throughout and only computes features. The LM speaks the target's vocabulary: a fresh one has
the target's logits width as its rows, an ``init_lm`` must share the target's tokenizer (or be a prefix of it; its
embeddings are then resized to the target's width) and the default ``text_lm`` (the embedded zoo LM, the embedded
tokenizer) is replaced by a fresh ``arch`` LM for a target whose tokenizer differs (logged).

Phase 1, projector pretraining (captioning alignment, LLaVA's pretraining stage): image-caption pairs, the world's
caption tasks (scenes, charts, signs, image sets, frames; reference captions, as LLaVA-Pretrain is); only the
projector trains (LM frozen); CE on the caption tokens. ``pretrain_total`` samples, ``pretrain_lr``.

Phase 2, SDViT (self-distilled visual instruction tuning): the *target* answers ``data_samples`` visual
instructions of the world's training mix (every prompt has images) by sampling with top-p at a spread of
temperatures (``temperatures``, sample i at temperatures[i % n]; 0 = greedy), "diverse sampling ... to represent the
full response distribution"; the drafter (projector + LM) fine-tunes on those answers: eq. 2, CE on the target's
tokens. ``sdvit_total`` samples, ``sdvit_lr``. Ablation ``sdvit=False`` ("MASSV w/o SDViT", Appendix C): the same
phase on the world's reference answers to the same prompts (vanilla visual instruction tuning).
Every ``text_every``-th phase-2 sample (0 = none) is instead the target's answer to a text-only conversation (the
world's ``text`` training split, ``data_samples // text_every`` of them, sampled the same way; reference answers in
the ablation): SDViT on visual instructions alone makes the LM forget plain text, which the ensemble's text member
and text-only requests need (not in the paper: its drafter keeps a text-only teacher's weights).
Every ``pool_every``-th phase-2 sample reads its images average-pooled (grids ``pool_grids`` in turn), IbED's
"fine-tuned through pooling", so one model serves the ``pooled`` member too (0 = never); a sample whose images do
not all share one square token grid (Qwen2.5-VL's follow the image's aspect) reads them whole instead.

With a conversation file (``data_file``; ``training/data/sources.py``, every record checked before anything runs):
prompts are rendered by the target's own processor and chat template (Qwen2.5-VL's ``image_grid_thw`` carried to
its vision tower), and the file's splits replace the world's:

- phase 1 reads the file's prompts with images (its ``vision`` split) with the file's own answers: the user's
  captions / answers play LLaVA-Pretrain's role (a file has no separate caption set, and the answers are text
  about the image, which is what aligning the projector needs);
- phase 2 samples the target's answers to those prompts as above (the ``text`` split for ``text_every``);
  ``answers="data"`` (``--answers data``) trains phase 2 on the file's answers instead, the w/o-SDViT ablation with
  the user's answers (``sdvit=False`` means the same with a file);
- the held-out set is the target's greedy answers to the file's ``eval`` split (its last records).

A file holds few prompts: ``data_samples``, ``text_samples`` and ``eval_samples`` are capped at what it holds
(logged), its prompts count from 0, and the sample order goes over them in seeded epochs.

Data are cached under ``<run_dir>/data`` (safetensors chunks of ``chunk`` answers, resumable; ``meta.json`` records
what defines them with the target's sha256 and the file's; a rerun that differs is refused); the world's held-out
set is the target's greedy answers to ``eval_samples`` prompts of the evaluation suites. Images are re-rendered from
the world index (or read again from the file).

Checkpoints (``<run_dir>/ckpt``: fp32 safetensors, the LM's config, optimizer via ``torch.save`` /
``torch.load(weights_only=True)``, state.json) every ``ckpt_every_s`` and at the end; a rerun resumes exactly (the
sample order is a pure function of the sample counter, the phase of the counter). Evaluation: teacher-forced CE,
top-1 agreement and the greedy chain tau (gamma 4) on the held-out answers, multimodal and text-only (same model,
images dropped). ``export_massv`` writes the model, the target's tokenizer beside it and ``specula.json`` (kind,
target_sha256) for ``specula serve --drafter DIR``.

    cfg = MassvTrainConfig(run_dir="runs/massv", target="target")
    export_massv(train(cfg), out=Path("zoo/weights/massv"))
    cfg = MassvTrainConfig(run_dir="runs/mine", target="ckpt/llava-1.5-7b-hf", data_file="data/convs.jsonl",
                           init_lm=None, arch="embedded")
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specula.training.drafters.distill_data import (Answer, cut_at_image_token, encode, load_answers, make_answers,
                                                    prompt_of, same_data, target_fingerprint, world_sample,
                                                    write_answers)
from specula.drafters.ensemble_members import Member, member_context
from specula.drafters.massv_model import MassvConfig, MassvModel
from specula.runtime.engine.prompts import EncodedPrompt
from specula.training.drafters.common import (Cadence, check_data_fields, chunks_to_make, data_count, data_source,
                                              data_start, epoch_order, recipe_processor, save_checkpoint,
                                              warmup_cosine)
from specula.zoo.store import ZOO_DIR, sibling_ref

MASSV_DIR = ZOO_DIR / "massv"
DEFAULT_INIT_LM = "text_lm"  # the embedded zoo's text-only drafter (the embedded tokenizer)
LM_CONFIG = "lm_config.json"  # the LM's config in a checkpoint (its vocabulary is the target's)
CAPTION_INSTRUCTION = "<image>Describe the image in detail."  # a caption prompt of the world (caption mode)
# phase 1 draws from the caption entries of the world's training mix only
CAPTION_MIX = {"caption": 2.0, "caption_short": 1.0, "chart_caption": 0.3, "ocr_caption": 0.3,
               "multi_caption": 0.2, "video_caption": 0.2}


@dataclass(frozen=True)
class MassvTrainConfig:
    run_dir: str = "runs/massv"
    target: str = "target"  # zoo name or directory of the target
    tokenizer_dir: str = ""  # processor: tokenizer + image processor; "" = the target's own (its directory)
    # data
    data_file: str = ""  # a conversation file (docs/training-data.md); "" = the embedded world's prompts
    image_root: str = ""  # where data_file's image paths resolve; "" = data_file's folder
    answers: str = "target"  # phase 2 on "target": its sampled answers (SDViT); "data": data_file's own answers
    init_lm: str | None = DEFAULT_INIT_LM  # zoo name / directory of the LM to start from; None = fresh ``arch``
    arch: str = "embedded"  # TextLMArch of a fresh LM
    feature: str = "pre_projector"  # target features the projector reads ("pre_projector" | "projected")
    # phase 1: projector pretraining on captions (LM frozen)
    pretrain_total: int = 20_000  # samples seen
    pretrain_lr: float = 1e-3
    # phase 2: SDViT on the target's own answers (or the world's, with sdvit=False)
    data_samples: int = 10_000  # target answers to visual instructions (with data_file: at most its prompts)
    sdvit_total: int = 40_000  # samples seen
    sdvit_lr: float = 3e-4
    sdvit: bool = True  # False: the "w/o SDViT" ablation (reference answers)
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # the target's sampling temperatures, in turn
    top_p: float = 0.9
    pool_every: int = 4  # every n-th phase-2 sample reads pooled features (0 = never)
    text_every: int = 0  # every n-th phase-2 sample is a text-only conversation (0 = never)
    pool_grids: tuple[int, ...] = (6, 3, 1)
    data_start: int = 3_000_000  # first training-stream index (apart from the target's and other recipes'); world only
    eval_samples: int = 64
    max_new_tokens: int = 96
    caption_max_tokens: int = 64
    chunk: int = 64
    gen_batch: int = 16
    # training
    pool: int = 64  # samples drawn at a time, split into token-budget batches
    token_budget: int = 8192
    warmup_samples: int = 500  # per phase
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every_s: float = 240.0
    eval_every_s: float = 600.0
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("pretrain_total", "data_samples", "sdvit_total", "max_new_tokens", "caption_max_tokens", "chunk",
                     "gen_batch", "pool", "token_budget", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MassvTrainConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("data_start", "eval_samples", "warmup_samples", "seed", "pool_every", "text_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"MassvTrainConfig.{name} must be an integer >= 0, got {v!r}")
        for name in ("pretrain_lr", "sdvit_lr", "grad_clip", "ckpt_every_s", "eval_every_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"MassvTrainConfig.{name} must be > 0, got {v!r}")
        if self.feature not in ("pre_projector", "projected"):
            raise ValueError(f"MassvTrainConfig.feature must be 'pre_projector' or 'projected', got {self.feature!r}")
        if not isinstance(self.sdvit, bool):
            raise ValueError(f"MassvTrainConfig.sdvit must be a bool, got {self.sdvit!r}")
        if not self.temperatures or any(not (isinstance(t, (int, float)) and 0 <= t <= 2) for t in self.temperatures):
            raise ValueError(f"MassvTrainConfig.temperatures must be a non-empty list in [0, 2], got "
                             f"{self.temperatures!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"MassvTrainConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.pool_grids):
            raise ValueError(f"MassvTrainConfig.pool_grids must be integers >= 1, got {self.pool_grids!r}")
        if self.pool_every and not self.pool_grids:
            raise ValueError("MassvTrainConfig.pool_grids is empty while pool_every > 0")
        if not 0 <= self.weight_decay:
            raise ValueError(f"MassvTrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        check_data_fields(self)

    @property
    def text_samples(self) -> int:
        """Text-only conversations answered for phase 2 (``text_every``)."""
        return max(self.data_samples // self.text_every, 1) if self.text_every else 0

    @property
    def distils(self) -> bool:
        """Phase 2 on the target's own sampled answers (SDViT); False: on reference answers (the world's or the
        file's: ``sdvit=False`` or ``answers="data"``)."""
        return self.sdvit and self.answers == "target"

    def data_key(self) -> dict:
        """What defines the cached answers besides the target's weights."""
        return {"target": self.target, "temperatures": list(self.temperatures), "top_p": self.top_p}

    def resume_key(self) -> dict:
        """What a checkpoint must share with a run that resumes it (the sample order and the model depend on it)."""
        keys = ("init_lm", "arch", "feature", "pretrain_total", "data_samples", "sdvit_total", "sdvit", "pool_every",
                "pool_grids", "data_start", "seed", "text_every", "data_file", "answers")
        return {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keys}


# ------------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Prompts:
    """Where a run's prompts come from and how many of each split it uses (module docstring)."""

    source: object  # a ConversationSource (training/data/sources.py), or None: the world, as the shipped drafters
    start: int  # first training prompt index: cfg.data_start in the world, 0 in a file
    vision: int  # phase-2 prompts with images (phase 1's too, with a file)
    text: int  # phase-2 text-only prompts (text_every)
    eval: int  # held-out prompts
    text_every: int  # cfg.text_every, 0 when the file has no text-only prompt

    @property
    def file(self) -> bool:
        return self.source is not None


def world_prompts(cfg: MassvTrainConfig) -> Prompts:
    return Prompts(None, cfg.data_start, cfg.data_samples, cfg.text_samples, cfg.eval_samples, cfg.text_every)


def open_prompts(cfg: MassvTrainConfig, processor, log=print) -> Prompts:
    """The world's prompts, or the conversation file's (checked whole first), each split capped at what it holds."""
    if not cfg.data_file:
        return world_prompts(cfg)
    source = data_source(cfg, processor, log=log)
    vision = data_count(source, "vision", cfg.data_samples, log)
    if not vision:
        raise ValueError(f"{cfg.data_file}: no training prompt has an image; massv trains a projector over the "
                         "target's image features, so it needs conversations with images")
    text = data_count(source, "text", cfg.text_samples, log) if cfg.text_every else 0
    if cfg.text_every and not text:
        log(f"data: {cfg.data_file} has no text-only training prompt: text_every {cfg.text_every} is ignored")
    return Prompts(source, data_start(cfg), vision, text, data_count(source, "eval", cfg.eval_samples, log),
                   cfg.text_every if text else 0)


def caption_sample(index: int, seed: int):
    """Phase 1's index-th image-caption pair: the caption entries of the world's training mix."""
    from specula.world.suites import train_stream

    return next(train_stream(seed=seed, start=index, weights={**{n: 0.0 for n in _mix_names()}, **CAPTION_MIX}))


def _mix_names() -> list[str]:
    from specula.world.suites import TRAIN_MIX

    return [m[0] for m in TRAIN_MIX]


def reference_answer(processor, sample) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(prompt ids [Lp] image tokens expanded, pixel_values or None, the world's reference response ids [Lr] with
    EOS)."""
    from specula.world.tokenizer import format_turns

    tok = processor.tokenizer
    ids, pix = encode(processor, sample)
    # one token per image mark
    short = tok(format_turns(sample.prompt, system=sample.system), add_special_tokens=False).input_ids
    full = tok(format_turns(sample.prompt, sample.response, sample.system), add_special_tokens=False).input_ids
    if full[: len(short)] != short:
        raise ValueError(f"the chat template's prompt is not a token prefix of prompt + answer ({sample.suite})")
    return ids, pix, torch.tensor(full[len(short):], dtype=torch.long)


def encoded_prompt(processor, split: str, index: int, seed: int, source=None) -> EncodedPrompt:
    """Prompt ``index`` of ``split``: the file's (``source``; Qwen's grid included) or the world's, encoded as the
    shipped drafters were trained (``distill_data.encode``)."""
    if source is not None:
        return source.get(split, index).prompt
    return EncodedPrompt(*encode(processor, world_sample(split, index, seed)))


@torch.no_grad()
def sampled_answers(target, processor, indices: list[int], cfg: MassvTrainConfig, split: str = "vision",
                    source=None) -> list[Answer]:
    """The target's answers to ``split`` prompts ``indices`` ("vision" or "text"; of ``source``, default the world),
    sampled (top-p) at ``cfg.temperatures`` in turn, via the engine's plain decoding (seeded per prompt: a rerun
    makes the same answers)."""
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.engine.prompts import eos_ids

    tok = processor.tokenizer
    engine = SpecEngine(target, None, eos_token_ids=[tok.eos_token_id] if source is None else eos_ids(tok, target))
    encoded = {i: encoded_prompt(processor, split, i, cfg.seed, source) for i in indices}
    out = []
    for g in range(0, len(indices), cfg.gen_batch):
        reqs = []
        for i in indices[g:g + cfg.gen_batch]:
            t = float(cfg.temperatures[i % len(cfg.temperatures)])
            params = SamplingParams(temperature=t, top_p=cfg.top_p if t > 0 else 1.0, seed=cfg.seed * 1_000_003 + i,
                                    max_tokens=cfg.max_new_tokens)
            reqs.append(encoded[i].request(f"v{i}", params))
        res = engine.generate(reqs)
        out += [Answer(split, i, encoded[i].input_ids,
                       cut_at_image_token(torch.tensor(res[f"v{i}"].tokens, dtype=torch.long),
                                          target.info.image_token_id))
                for i in indices[g:g + cfg.gen_batch]]
    return out


def make_sdvit_data(folder: Path, target, processor, cfg: MassvTrainConfig, fingerprint: str, log=print,
                    prompts: Prompts | None = None) -> Path:
    """Phase 2's answers (resumable chunks ``vision-<first>.safetensors``) and the held-out greedy answers, to the
    prompts of ``prompts`` (default the world's)."""
    p = prompts or world_prompts(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    key = {**cfg.data_key(), "target_sha256": fingerprint, "start": p.start, "seed": cfg.seed,
           "max_new_tokens": cfg.max_new_tokens, "chunk": cfg.chunk, **(p.source.key if p.file else {})}
    meta = folder / "meta.json"
    if meta.exists() and not same_data(json.loads(meta.read_text()), key):
        raise ValueError(f"{folder} holds answers made with {json.loads(meta.read_text())}; this run asks for {key}: "
                         f"use another run_dir")
    meta.write_text(json.dumps(key, indent=1) + "\n")
    if p.eval:  # the target's greedy answers to the held-out prompts (distill_data's held-out set)
        make_answers(folder / "eval", target, processor, key={"target_sha256": fingerprint}, n=0, eval_n=p.eval,
                     seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, gen_batch=cfg.gen_batch, log=log,
                     source=p.source)
    if not cfg.distils:
        return folder
    for split, total in (("vision", p.vision), ("text", p.text)):
        todo, done = chunks_to_make(folder, split, total, cfg.chunk) if total else ([], 0)
        if done:
            log(f"data: {done} of {total} target answers ({split}) already in {folder}")
        bar = tqdm(total=total, initial=done, unit="sample", mininterval=5.0, disable=not todo,
                   desc="massv data (SDViT)" if split == "vision" else "massv data (text)")
        for s in todo:
            n = min(cfg.chunk, total - s)
            answers = sampled_answers(target, processor, list(range(p.start + s, p.start + s + n)), cfg, split,
                                      p.source)
            write_answers(folder / f"{split}-{s:08d}.safetensors", answers, key)
            bar.update(n)
        bar.close()
    return folder


# ------------------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Item:
    prompt: torch.Tensor  # [Lp] int64, image tokens expanded
    response: torch.Tensor  # [Lr] int64
    pixel_values: torch.Tensor | None  # LLaVA [N_img, 3, S, S]; Qwen2.5-VL [P, C*tp*p*p] patches
    grid: int | None = None  # pooled to grid x grid per image (None = every visual token)
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] int64, Qwen2.5-VL only


def data_item(source, split: str, index: int, max_tokens: int) -> Item:
    """Prompt ``index`` of the file's ``split`` with the file's own answer (cut at ``max_tokens``)."""
    sp = source.get(split, index)
    return Item(sp.prompt.input_ids, sp.answer_ids[:max_tokens], sp.prompt.pixel_values,
                image_grid_thw=sp.prompt.image_grid_thw)


def answer_item(processor, a: Answer, seed: int, source=None, grid: int | None = None) -> Item:
    """A cached answer with its images read again (from ``source``, default the world)."""
    enc = prompt_of(processor, a, seed, source)
    return Item(a.prompt, a.response, enc.pixel_values, grid, enc.image_grid_thw)


def phase_of(j: int, cfg: MassvTrainConfig) -> int:
    return 1 if j < cfg.pretrain_total else 2


def lr_at(j: int, cfg: MassvTrainConfig) -> float:
    """Warmup then cosine decay, within each phase (its own peak)."""
    start, total, peak = (0, cfg.pretrain_total, cfg.pretrain_lr) if phase_of(j, cfg) == 1 else \
        (cfg.pretrain_total, cfg.sdvit_total, cfg.sdvit_lr)
    return warmup_cosine(j - start, min(cfg.warmup_samples, total // 4), total, peak)


def features(target, pix: torch.Tensor, variant: str, image_grid_thw: torch.Tensor | None = None):
    """The frozen target's features of an item's images (``VisualFeatures``: [N_img, T_max, D] padded, per-image
    lengths and token grids); ``image_grid_thw`` [N_img, 3] for Qwen2.5-VL."""
    with torch.no_grad():
        return target.encode_images(pix, "pre_projector" if variant == "pre_projector" else "projected",
                                    image_grid_thw=image_grid_thw)


def item_context(model: MassvModel, target, it: Item, device) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's context of an item: its token ids and the feature rows of its image tokens [n, D] fp32, in
    order. ``it.grid``: pooled, when every image has the same square token grid (else every visual token)."""
    image = model.config.image_token_id
    if it.pixel_values is None:
        return member_context(Member("multimodal"), it.prompt.tolist(), None, None, image)
    vf = features(target, it.pixel_values, model.config.feature, it.image_grid_thw)
    per = [f.float() for f in vf.per_image()]  # each [T_i, D]
    if it.grid and len(set(vf.lengths)) == 1 and all(h == w for h, w in vf.grid_hw):
        return member_context(Member("pooled", grid=(it.grid, it.grid)), it.prompt.tolist(),
                              torch.stack(per).to(device), None, image)
    return it.prompt.tolist(), torch.cat(per).to(device)  # [n, D], the prompt's image tokens in order


def losses(model: MassvModel, target, items: list[Item], pad_id: int, device) -> dict[str, torch.Tensor]:
    """CE of the drafter on every response token (context: the item's prompt, images as projected features)."""
    seqs, visual, spans = [], [], []
    for it in items:
        toks, vis = item_context(model, target, it, device)
        spans.append((len(toks), len(it.response)))
        seqs.append(toks + it.response.tolist())
        visual.append(vis)
    ids = torch.full((len(items), max(len(s) for s in seqs)), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros_like(ids)
    rows, cols = [], []
    for b, (s, (lp, lr)) in enumerate(zip(seqs, spans)):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
        rows.append(torch.full((lr,), b, dtype=torch.long))
        cols.append(torch.arange(lp - 1, lp + lr - 1))
    ids, mask = ids.to(device), mask.to(device)
    rows, cols = torch.cat(rows).to(device), torch.cat(cols).to(device)
    emb = model.embed(ids, visual)  # [B, L, H]
    hidden = model.lm.model(inputs_embeds=emb, attention_mask=mask).last_hidden_state  # [B, L, H]
    logp = model.lm.lm_head(hidden[rows, cols]).float().log_softmax(-1)  # [M, V]
    tgt = ids[rows, cols + 1]  # [M]
    return {"ce": -logp.gather(1, tgt[:, None]).mean(), "agree": (logp.argmax(-1) == tgt).float().mean()}


@torch.no_grad()
def evaluate(model: MassvModel, target, processor, answers: list[Answer], cfg: MassvTrainConfig,
             source=None) -> dict:
    """Teacher-forced CE / agreement and greedy chain tau (gamma 4) on the target's held-out greedy answers, with the
    images (multimodal) and without them (text-only, the same LM): the MASSV-over-text-only gap. ``source``: where
    the answers' prompts come from (default the world)."""
    from specula.training.drafters.text_lm import greedy_tau

    was = model.training
    model.eval()
    res = {}
    for name, drop in (("", False), ("_text", True)):
        ce = agree = n = counted = blocks = 0
        for a in answers:
            if len(a.response) < 1:
                continue
            if drop:
                it = Item(a.prompt[a.prompt != model.config.image_token_id], a.response, None)
            else:
                it = answer_item(processor, a, cfg.seed, source)
            parts, hits = _eval_one(model, target, it, processor.tokenizer.pad_token_id, cfg.device)
            m = len(a.response)
            ce, agree, n = ce + parts * m, agree + sum(hits), n + m
            c, b = greedy_tau(hits)
            counted, blocks = counted + c, blocks + b
        res[f"eval_ce{name}"] = round(ce / max(n, 1), 4)
        res[f"eval_agree{name}"] = round(agree / max(n, 1), 4)
        res[f"eval_tau_g4{name}"] = round(counted / max(blocks, 1), 3)
    model.train(was)
    return res


def _eval_one(model, target, it: Item, pad_id: int, device) -> tuple[float, list[bool]]:
    toks, vis = item_context(model, target, it, device)
    ids = torch.tensor([toks + it.response.tolist()], device=device)
    hidden = model.lm.model(inputs_embeds=model.embed(ids, [vis])).last_hidden_state[0]  # [L, H]
    lp = len(toks)
    logp = model.lm.lm_head(hidden[lp - 1: lp - 1 + len(it.response)]).float().log_softmax(-1)  # [Lr, V]
    tgt = it.response.to(device)
    return float(-logp.gather(1, tgt[:, None]).mean()), (logp.argmax(-1) == tgt).tolist()


def starting_lm(cfg: MassvTrainConfig, target, tokenizer, log=print) -> str | None:
    """The LM to start from: ``cfg.init_lm`` when it shares the target's tokenizer (or a prefix of it,
    ``drafters/vocab.py``), None (a fresh ``arch`` LM) when it is the default ``text_lm`` and does not (a target
    other than the embedded one); any other LM that does not is refused, naming what differs."""
    from transformers import AutoConfig

    from specula.drafters.text_lm import _own_tokenizer
    from specula.drafters.vocab import check_vocab
    from specula.zoo.store import resolve

    if not cfg.init_lm:
        return None
    default = cfg.init_lm == DEFAULT_INIT_LM
    try:
        d = resolve(cfg.init_lm)
    except FileNotFoundError:
        if not default:
            raise
        log(f"massv: no {DEFAULT_INIT_LM} in the zoo: starting from a fresh --arch {cfg.arch} LM")
        return None
    rows = AutoConfig.from_pretrained(d, local_files_only=True).vocab_size
    try:
        check_vocab("massv", rows, target.info.vocab_size, _own_tokenizer(d), tokenizer)
    except ValueError as e:
        if default:
            log(f"massv: the default --init-lm {DEFAULT_INIT_LM} (the embedded zoo LM) does not speak this target's "
                f"tokenizer ({e}); starting from a fresh --arch {cfg.arch} LM over the target's "
                f"{target.info.vocab_size} ids instead")
            return None
        why = str(e).removeprefix("massv: ")
        raise ValueError(f"massv: --init-lm {cfg.init_lm} cannot draft for {cfg.target}: {why}. Use --init-lm none "
                         "--arch tiny|embedded (a fresh LM over the target's vocabulary), or a small Llama causal LM "
                         "directory saved with the target's tokenizer") from None
    return cfg.init_lm


def caption_prompt(tokenizer, image_token_id: int, processor=None) -> tuple[int, ...]:
    """The caption instruction as the drafter's caption mode reads it (ONE image token): the world's format, or
    with ``processor`` the checkpoint's own chat template; () when the template does not spell an image as one
    token (no caption mode)."""
    from specula.runtime.engine.prompts import prompt_messages, render
    from specula.world.tokenizer import format_turns

    if processor is None:
        return tuple(tokenizer(format_turns(CAPTION_INSTRUCTION), add_special_tokens=False).input_ids)
    text = render(processor, prompt_messages(CAPTION_INSTRUCTION, 1))
    special = not (tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token))
    ids = tuple(tokenizer(text, add_special_tokens=special).input_ids)
    return ids if ids.count(image_token_id) == 1 else ()


def build(cfg: MassvTrainConfig, target, tokenizer, processor=None) -> MassvModel:
    """The starting model: ``init_lm`` (or a fresh ``arch``) over the target's vocabulary (its logits width) + a new
    projector sized for the target's features, caption mode set up (the caption instruction, EOS; ``processor``:
    the instruction through its chat template, else the world's format)."""
    from transformers import LlamaForCausalLM

    from specula.training.drafters.text_lm_config import TextLMArch, build_config
    from specula.zoo.store import resolve

    width = target.info.vocab_size
    with torch.random.fork_rng():  # seeded init without touching the caller's global RNG
        torch.manual_seed(cfg.seed)
        if cfg.init_lm:
            lm = LlamaForCausalLM.from_pretrained(resolve(cfg.init_lm), dtype=torch.float32, local_files_only=True)
            if lm.config.vocab_size != width:  # a prefix of the target's tokenizer: a row for every target id
                lm.resize_token_embeddings(width)
        else:
            config = build_config(TextLMArch.from_name(cfg.arch), tokenizer)
            config.vocab_size = width
            lm = LlamaForCausalLM(config)
    info = target.info
    mcfg = MassvConfig(feature_dim=feature_dim(target, cfg.feature), image_token_id=info.image_token_id,
                       feature=cfg.feature, caption_prompt=caption_prompt(tokenizer, info.image_token_id, processor),
                       caption_max_tokens=cfg.caption_max_tokens, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        return MassvModel(lm.float(), mcfg).to(cfg.device)


def feature_dim(target, feature: str) -> int:
    """D of the target features the projector reads: LLaVA's pre-projector features are the selected vision layers
    side by side, Qwen2.5-VL's a merge unit's patches (D_vis * merge**2); projected ones the LM's width."""
    info = target.info
    if feature == "projected":
        return info.hidden_size
    if info.model_type == "qwen2_5_vl":
        return info.vision_hidden_size * target.model.config.vision_config.spatial_merge_size ** 2
    return info.vision_hidden_size * len(_feature_layers(target))


def _feature_layers(target) -> list:
    layers = getattr(target.model.config, "vision_feature_layer", -1)
    return [layers] if isinstance(layers, int) else list(layers)


def train(cfg: MassvTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make the data (resumable), then run both phases (resumable); returns the checkpoint folder. ``stop_at``: stop
    with a checkpoint once that many samples are done."""
    from specula.targets import load_target
    from specula.zoo.store import resolve

    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())["config"]
        # a key the checkpoint predates had its default then (e.g. text_every = 0)
        old = {k: old.get(k, getattr(MassvTrainConfig, k, None)) for k in cfg.resume_key()}
        theirs = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in old.items()}
        if theirs != cfg.resume_key():
            raise ValueError(f"{ckpt} was trained with {theirs}; this run asks for {cfg.resume_key()}: use another "
                             f"run_dir")
    target_dir = resolve(cfg.target)
    processor = recipe_processor(cfg, target_dir)
    tok = processor.tokenizer
    prompts = open_prompts(cfg, processor, log)  # a conversation file is checked whole before anything runs
    target = load_target(target_dir, device=cfg.device)
    target.model.requires_grad_(False)
    init_lm = starting_lm(cfg, target, tok, log)
    fingerprint = target_fingerprint(target_dir)
    data_dir = make_sdvit_data(run / "data", target, processor, cfg, fingerprint, log, prompts)
    sdvit = load_answers(data_dir, "vision", prompts.vision) if cfg.distils else []
    texts = load_answers(data_dir, "text", prompts.text) if cfg.distils and prompts.text else []
    held_out = load_answers(data_dir / "eval", "eval", prompts.eval) if prompts.eval else []
    model = build(replace(cfg, init_lm=init_lm), target, tok, processor if prompts.file else None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    total = cfg.pretrain_total + cfg.sdvit_total
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg),
             "target_sha256": fingerprint, "massv_config": json.loads(model.config.to_json()), "init_lm": init_lm}

    def optimizer(phase: int) -> torch.optim.Optimizer:
        """Phase 1: the projector only (LM frozen); phase 2: projector + LM."""
        model.lm.requires_grad_(phase == 2)
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=cfg.pretrain_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    phase = 1
    opt = optimizer(phase)
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())
        if old.get("target_sha256") != fingerprint:
            raise ValueError(f"{ckpt} was trained against another target; use another run_dir")
        model.load_state_dict(load_file(ckpt / "model.safetensors", device=str(cfg.device)), strict=False)
        model.lm.tie_weights()
        state.update({k: old[k] for k in ("samples", "steps", "elapsed_s", "history")})
        phase = old["phase"]
        opt = optimizer(phase)
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=cfg.device))
        log(f"resumed from {ckpt}: {state['samples']} samples (phase {phase}), {state['elapsed_s'] / 60:.1f} min")
    n_params = sum(p.numel() for p in model.parameters())
    whose = "the target" if cfg.distils else ("the file (w/o SDViT)" if prompts.file else "the world (w/o SDViT)")
    log(f"massv: {n_params / 1e6:.2f} M params (projector {sum(p.numel() for p in model.projector.parameters())}), "
        f"phase 1 {cfg.pretrain_total} caption samples, phase 2 {cfg.sdvit_total} samples on "
        f"{whose}'s answers to {prompts.vision} prompts")

    orders: dict = {}
    text_orders: dict = {}
    caption_orders: dict = {}
    src, every = prompts.source, prompts.text_every

    def pick(j: int) -> Item:
        if phase_of(j, cfg) == 1:
            if prompts.file:  # the file's image prompts with its own answers (module docstring)
                i = epoch_order(j, prompts.vision, cfg.seed + 2, caption_orders)
                return data_item(src, "vision", i, cfg.max_new_tokens)
            ids, pix, ref = reference_answer(processor, caption_sample(cfg.data_start + j, cfg.seed))
            return Item(ids, ref, pix)
        k = j - cfg.pretrain_total
        if every and k % every == every - 1:  # a text-only conversation
            i = epoch_order(k // every, prompts.text, cfg.seed + 1, text_orders)
            if cfg.distils:
                return Item(texts[i].prompt, texts[i].response, None)
            if prompts.file:
                return data_item(src, "text", i, cfg.max_new_tokens)
            ids, _, ref = reference_answer(processor, world_sample("text", cfg.data_start + i, cfg.seed))
            return Item(ids, ref, None)
        i = epoch_order(k, prompts.vision, cfg.seed, orders)
        grid = cfg.pool_grids[(k // cfg.pool_every) % len(cfg.pool_grids)] \
            if cfg.pool_every and k % cfg.pool_every == cfg.pool_every - 1 else None
        if cfg.distils:
            return answer_item(processor, sdvit[i], cfg.seed, src, grid)
        if prompts.file:
            return replace(data_item(src, "vision", i, cfg.max_new_tokens), grid=grid)
        ids, pix, ref = reference_answer(processor, world_sample("vision", cfg.data_start + i, cfg.seed))
        return Item(ids, ref, pix, grid)

    def save() -> None:
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm.lm_head.weight"}
        save_checkpoint(ckpt, "model.safetensors", sd, opt, {**state, "phase": phase},
                        {LM_CONFIG: model.lm.config.to_json_string()})

    ema: dict[str, float] = {}

    def run_eval() -> None:
        if held_out:
            res = evaluate(model, target, processor, held_out, cfg, src)
            res.update(samples=state["samples"], phase=phase_of(max(state["samples"] - 1, 0), cfg),
                       minutes=round(state["elapsed_s"] / 60, 1), **{f"loss_{k}": round(v, 4) for k, v in ema.items()})
            state["history"].append(res)
            log(json.dumps(res))

    model.train()
    bar = tqdm(total=total, initial=state["samples"], unit="sample", desc="train massv", mininterval=5.0)
    clock = Cadence(state, cfg.eval_every_s, cfg.ckpt_every_s)
    while state["samples"] < total:
        if stop_at is not None and state["samples"] >= stop_at:
            break
        start = state["samples"]
        if phase_of(start, cfg) != phase:  # phase 2 begins: the LM joins, a fresh optimizer
            phase = 2
            opt = optimizer(phase)
            ema.clear()
        end = min(start + cfg.pool, cfg.pretrain_total if phase == 1 else total)
        items = sorted((pick(j) for j in range(start, end)), key=lambda it: len(it.prompt) + len(it.response))
        groups, cur = [], []
        for it in items:  # token-budget batches
            if cur and (len(cur) + 1) * (len(it.prompt) + len(it.response)) > cfg.token_budget:
                groups.append(cur)
                cur = []
            cur.append(it)
        groups += [cur] if cur else []
        for group in groups:
            for g in opt.param_groups:
                g["lr"] = lr_at(state["samples"], cfg)
            parts = losses(model, target, group, pad, cfg.device)
            opt.zero_grad(set_to_none=True)
            parts["ce"].backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
            opt.step()
            state["steps"] += 1
            state["samples"] += len(group)
            bar.update(len(group))
            for k, v in parts.items():
                x = float(v.detach())
                ema[k] = 0.9 * ema.get(k, x) + 0.1 * x
        bar.set_postfix({"phase": phase, **{k: f"{v:.3f}" for k, v in ema.items()}}, refresh=False)
        clock.tick(run_eval, save)
    bar.close()
    if state["samples"] >= total and (not state["history"] or state["history"][-1].get("samples") != total):
        run_eval()
    save()
    return ckpt


# ------------------------------------------------------------------------------------------------------- export


def export_massv(ckpt: Path, out: Path = MASSV_DIR, tokenizer_dir: Path | str | None = None) -> Path:
    """Checkpoint -> ``out``: the LM (fp16 storage, fp32 compute) + projector + ``massv_config.json`` + the target's
    tokenizer (``tokenizer_dir``: another; default the run's processor, the target's own unless it named one) +
    ``specula.json`` (kind, target_sha256: what ``specula serve`` checks); rewrites the zoo manifest when ``out`` is
    in the zoo."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from specula.targets.processor import load_processor
    from specula.zoo import store as manifest
    from specula.zoo.store import resolve

    ckpt, out = Path(ckpt), Path(out)
    state = json.loads((ckpt / "state.json").read_text())
    c = state["config"]
    tok = load_processor(tokenizer_dir or c.get("tokenizer_dir") or resolve(c["target"])).tokenizer
    sd = load_file(ckpt / "model.safetensors")
    init_lm = state.get("init_lm", c["init_lm"])  # what the run started from (a fresh LM for another tokenizer)
    if (ckpt / LM_CONFIG).exists():
        lm = LlamaForCausalLM(LlamaConfig.from_json_file(ckpt / LM_CONFIG))
    elif c["init_lm"]:  # a checkpoint from before LM_CONFIG
        lm = LlamaForCausalLM(AutoConfig.from_pretrained(resolve(c["init_lm"]), local_files_only=True))
    else:
        from specula.training.drafters.text_lm_config import TextLMArch, build_model

        lm = build_model(TextLMArch.from_name(c["arch"]), tok)
    model = MassvModel(lm.float(), MassvConfig.from_json(json.dumps(state["massv_config"])))
    model.load_state_dict(sd, strict=False)
    model.lm.tie_weights()
    if out.exists():
        shutil.rmtree(out)
    model.save(out, torch.float16)
    tok.save_pretrained(out)
    last = state["history"][-1] if state["history"] else {}
    info = {"kind": "massv", "params": sum(p.numel() for p in model.parameters()),
            "image_token_id": model.config.image_token_id, "feature": model.config.feature,
            "target": sibling_ref(c["target"], out), "target_sha256": state["target_sha256"],
            "init_lm": sibling_ref(init_lm, out) if init_lm else init_lm,
            "sdvit": c["sdvit"], "pretrain_samples": c["pretrain_total"], "sdvit_samples": c["sdvit_total"],
            "data_samples": c["data_samples"], "text_every": c.get("text_every", 0),
            "data_file": c.get("data_file") or None, "answers": c.get("answers", "target"),
            "trained_samples": state["samples"],
            "train_minutes": round(state["elapsed_s"] / 60, 1), "device": c.get("device", "cpu"),
            "eval_tau_g4": last.get("eval_tau_g4"),
            "eval_tau_g4_text": last.get("eval_tau_g4_text"), "history": state["history"],
            "storage_dtype": "float16"}
    (out / "specula.json").write_text(json.dumps(info, indent=1) + "\n")
    if out.resolve().parent == ZOO_DIR.resolve():
        manifest.write(out.parent)
    return out


def train_massv_cli(args) -> int:
    """``specula train massv``: run_dir, target, data, image_root, answers, init_lm ("none" = fresh --arch), arch,
    feature, pretrain_samples, data_samples, samples (phase 2), max_new_tokens, no_sdvit, text_every, seed, threads,
    device, ckpt_every, eval_every, export, out. ``--no-sdvit`` with the default run_dir trains in
    runs/massv-no-sdvit and exports to zoo/weights/massv-no-sdvit."""
    from specula.training.drafters.eagle import data_cli_config

    suffix = "-no-sdvit" if args.no_sdvit else ""
    run_dir = args.run_dir if not (suffix and args.run_dir == "runs/massv") else f"runs/massv{suffix}"
    cfg = MassvTrainConfig(run_dir=run_dir, target=args.target,
                           init_lm=None if str(args.init_lm).lower() == "none" else args.init_lm, arch=args.arch,
                           feature=args.feature, pretrain_total=args.pretrain_samples, data_samples=args.data_samples,
                           sdvit_total=args.samples, max_new_tokens=args.max_new_tokens, sdvit=not args.no_sdvit,
                           text_every=args.text_every,
                           seed=args.seed, threads=args.threads, device=args.device, ckpt_every_s=args.ckpt_every,
                           eval_every_s=args.eval_every, **data_cli_config(args))
    ckpt = train(cfg)
    if args.export:
        out = Path(args.out) if args.out else ZOO_DIR / f"massv{suffix}"
        print(f"exported to {export_massv(ckpt, out)}")
    return 0
