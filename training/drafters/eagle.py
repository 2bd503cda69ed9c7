"""``specula train eagle``: train the EAGLE head on the target's own answers and hidden states.

Recipe (EAGLE-1, Li et al. 2024, as the MSD paper's feature-level baseline):

1. Data (``training/drafters/distill_data.py``, resumable): the target answers ``data_samples`` world training prompts
   greedily, with its images, up to EOS or ``max_new_tokens``; plus ``eval_samples`` held-out prompts of the
   evaluation suites. Only ids are stored; images are re-rendered from the world index when needed.
2. Training, teacher-forced over whole sequences: per batch the frozen target runs once over prompt + answer (no
   grad; images included) and gives h_0 .. h_{L-1} (final-norm); the head runs once over the pairs
   (h_i + noise, x_{i+1}), causal, and at every answer position i in [Lp - 1, L - 3] (its output h^_{i+1} drafts
   x_{i+2}, an answer token) the loss is
       SmoothL1(h^_{i+1}, h_{i+1}) + ce_weight * ((1 - soft) * CE(lm_head(h^_{i+1}), x_{i+2})
                                                  + soft * CE(lm_head(h^_{i+1}), softmax(lm_head(h_{i+1}))))
   The regression is EAGLE's feature loss; the first CE term is the target's own next token (greedy acceptance),
   the second its whole distribution at temperature 1 (sampled acceptance is sum min(p, q)), as EAGLE's p-loss.
   ``noise``: uniform noise in [-noise/2, noise/2] on the input features, EAGLE's answer to feature-error
   accumulation at draft time. The target's embedding and lm_head are frozen and shared, never trained.
   AdamW, warmup then cosine decay, gradient clipping; epochs over the answers in a seeded order, ``pool``
   answers at a time split into token-budget batches.
3. Checkpoints: ``<run_dir>/ckpt`` (fp32 safetensors, optimizer via ``torch.save`` / ``torch.load(weights_only=
   True)``, state.json) every ``ckpt_every_s`` seconds and at the end; a rerun resumes. The batch order is a pure
   function of the sample counter and the noise of the step counter, so a resumed run sees the same batches.
   Evaluation on the held-out answers: teacher-forced top-1 agreement and CE, and the real mean accepted length
   (tau) of greedy chain drafting (gamma 4) through ``SpecEngine`` on ``eval_engine`` held-out prompts.
4. ``export_eagle``: fp16 ``eagle.safetensors`` + ``eagle_config.json`` + ``specula.json``; the zoo manifest is
   rewritten when the export goes into the zoo. ``load_eagle(dir, target)`` loads it back.

Shared with the other recipes of ``EagleHead`` subclasses (``training/drafters/msd.py``): ``open_run``, ``new_head``,
``fit`` (the loop of steps 2-3 over any sample order ``pick(j)``), ``losses`` / ``target_features`` (a head that
``reads_visual`` also gets the target's input embeddings, visual ones at image tokens), ``evaluate`` (tau with the
head's own drafter kind) and ``export_head``.

    cfg = EagleTrainConfig(run_dir="runs/eagle", target="target")
    export_eagle(train(cfg), out=Path("zoo/weights/eagle"))
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from specula.training.drafters.distill_data import Answer, load_answers, make_answers, prompt_of, target_fingerprint
from specula.drafters.eagle_head import EagleHead, save_head
from specula.training.drafters.common import (Cadence, check_data_fields, data_count, data_source, data_start, epoch_order,
                                              recipe_processor, save_checkpoint, warmup_cosine)
from specula.training.drafters.warm_start import lineage_samples, warm_start
from specula.zoo.store import ZOO_DIR, sibling_ref

EAGLE_DIR = ZOO_DIR / "eagle"


@dataclass(frozen=True)
class EagleTrainConfig:
    run_dir: str = "runs/eagle"
    target: str = "target"  # zoo name or directory of the target
    tokenizer_dir: str = ""  # processor: tokenizer + image processor; "" = the target's own (its directory)
    # data
    data_file: str = ""  # a conversation file (docs/training-data.md); "" = the embedded world's prompts
    image_root: str = ""  # where data_file's image paths resolve; "" = data_file's folder
    answers: str = "target"  # "target": its greedy answers (self-distillation); "data": data_file's own answers
    data_samples: int = 10_000
    data_start: int = 2_000_000  # first train_stream index (the target trained on 0 .. ~60k)
    eval_samples: int = 128
    max_new_tokens: int = 96  # the world's answers are <= ~80 tokens
    chunk: int = 64  # answers per data file
    gen_batch: int = 16  # prompts per batched target generation
    # training
    total_samples: int = 60_000  # samples seen in all (epochs = total / data)
    pool: int = 128
    token_budget: int = 8192  # rows x longest row per batch
    lr: float = 1e-3
    warmup_samples: int = 2_000
    weight_decay: float = 0.0
    ce_weight: float = 0.1  # EAGLE's p-loss weight (the feature loss has weight 1)
    soft: float = 0.5  # share of the CE against the target's distribution (rest: its next token)
    noise: float = 0.2  # width of the uniform noise on input features
    grad_clip: float = 0.5
    seed: int = 0
    ckpt_every_s: float = 240.0
    eval_every_s: float = 600.0
    eval_engine: int = 24  # held-out prompts decoded through SpecEngine for tau (0 = skip)
    threads: int = 1
    device: str = "cpu"
    init_from: str = ""  # an exported head of the same kind and config to start from (training/drafters/warm_start.py); "" = fresh

    def __post_init__(self) -> None:
        for name in ("data_samples", "max_new_tokens", "chunk", "gen_batch", "total_samples", "pool", "token_budget",
                     "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= 1, got {v!r}")
        for name in ("data_start", "eval_samples", "warmup_samples", "seed", "eval_engine"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= 0, got {v!r}")
        if self.eval_engine > self.eval_samples:
            raise ValueError(f"{type(self).__name__}.eval_engine must be <= eval_samples")
        for name in ("lr", "ckpt_every_s", "eval_every_s", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{type(self).__name__}.{name} must be > 0, got {v!r}")
        for name in ("weight_decay", "ce_weight", "noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 0, got {v!r}")
        if not 0.0 <= self.soft <= 1.0:
            raise ValueError(f"{type(self).__name__}.soft must be in [0, 1], got {self.soft!r}")
        check_data_fields(self)

    def data_key(self) -> dict:
        """What defines the cached answers besides the target's weights."""
        return {"target": self.target}


# ------------------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, prompt then answer, right-padded
    attention_mask: torch.Tensor  # [B, L] int64
    pixel_values: torch.Tensor | None  # LLaVA [N_img, 3, S, S] / Qwen2.5-VL [P, C*tp*p*p]: the rows' images in order
    rows: torch.Tensor  # [M] int64, row of each scored position
    cols: torch.Tensor  # [M] int64, pair index i (the head's output there drafts x_{i+2})
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] int64, Qwen2.5-VL only


def collate(items: list[Answer], processor, seed: int, pad_id: int | None, source=None) -> Batch:
    """Right-padded prompt + answer rows, their images re-rendered from ``source`` (default the world)."""
    seqs = [torch.cat([a.prompt, a.response]) for a in items]
    ids = torch.full((len(items), max(len(s) for s in seqs)), pad_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, pix, grids = [], [], [], []
    for b, (a, s) in enumerate(zip(items, seqs)):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
        lp, n = len(a.prompt), len(s)
        rows.append(torch.full((max(n - lp - 1, 0),), b, dtype=torch.long))
        cols.append(torch.arange(lp - 1, n - 2))
        enc = prompt_of(processor, a, seed, source)
        if enc.pixel_values is not None:
            pix.append(enc.pixel_values)
            if enc.image_grid_thw is not None:
                grids.append(enc.image_grid_thw)
    return Batch(ids, mask, torch.cat(pix) if pix else None, torch.cat(rows), torch.cat(cols),
                 torch.cat(grids) if grids else None)


def vision_kwargs(model, batch: Batch, device) -> dict:
    """The HF model's image inputs for a batch: ``pixel_values`` in the model's dtype and, on Qwen2.5-VL, its
    ``image_grid_thw`` and the ``mm_token_type_ids`` its mrope positions are built from (1 at image tokens)."""
    kw = {}
    if batch.pixel_values is not None:
        kw["pixel_values"] = batch.pixel_values.to(device, next(model.parameters()).dtype)
    if getattr(model.config, "model_type", "").startswith("qwen"):
        kw["mm_token_type_ids"] = (batch.input_ids == model.config.image_token_id).int().to(device)  # [B, L]
        if batch.image_grid_thw is not None:
            kw["image_grid_thw"] = batch.image_grid_thw.to(device)
    return kw


def token_budget_batches(items: list[Answer], budget: int) -> list[list[Answer]]:
    """Group by length so that rows x longest row stays under ``budget`` tokens."""
    items = sorted(items, key=lambda a: len(a.prompt) + len(a.response))
    groups, cur, longest = [], [], 0
    for a in items:
        n = len(a.prompt) + len(a.response)
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(a)
        longest = max(longest, n)
    return groups + ([cur] if cur else [])


@torch.no_grad()
def target_hidden(model, batch: Batch, device) -> torch.Tensor:
    """The frozen target's final-norm hidden states over the batch: [B, L, H] fp32."""
    return target_features(model, batch, device)[0]


@torch.no_grad()
def target_features(model, batch: Batch, device, embeds: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen target's final-norm hidden states [B, L, H] fp32 and, with ``embeds``, the input embeddings its
    language model read [B, L, H] fp32 (projected visual embeddings at image tokens): one target forward."""
    seen: list[torch.Tensor] = []

    def grab(module, args, kwargs):  # the merged text + visual embeddings, exactly as the LM gets them
        seen.append(kwargs["inputs_embeds"].detach())

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True) if embeds else None
    try:
        out = model.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                          **vision_kwargs(model, batch, device))
    finally:
        if hook is not None:
            hook.remove()
    return out.last_hidden_state.float(), (seen[0].float() if embeds else None)


def losses(head: EagleHead, hidden: torch.Tensor, batch: Batch, cfg: EagleTrainConfig,
           generator: torch.Generator | None = None, embeds: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One teacher-forced pass of the head over every sequence of the batch (module docstring).

    hidden [B, L, H] fp32 target features; embeds [B, L, H] the target's input embeddings (``target_features``),
    given to a head that ``reads_visual`` (MSD: its input at the image positions); returns the total ``loss`` and
    its parts (feat, hard, soft, agree).
    """
    dev = hidden.device
    b, seq, _ = hidden.shape
    ids = batch.input_ids.to(dev)
    h_in = hidden[:, :-1]  # [B, L-1, H] h_i
    if cfg.noise > 0:
        u = torch.rand(h_in.shape, generator=generator, device=generator.device if generator is not None else "cpu")
        h_in = h_in + (u.to(dev) - 0.5) * cfg.noise
    valid = batch.attention_mask[:, 1:].bool().to(dev)  # [B, L-1] pair i is real iff x_{i+1} is
    causal = torch.ones(seq - 1, seq - 1, dtype=torch.bool, device=dev).tril()
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(seq - 1, dtype=torch.bool, device=dev)[None]
    from specula.targets.kv import attention_mask

    mask = attention_mask(allowed[:, None], head.llama_config._attn_implementation, head.fc.weight.dtype)
    pos = torch.arange(seq - 1, device=dev).expand(b, -1)
    extra = {}
    if head.reads_visual:
        if embeds is None:
            raise ValueError(f"{head.KIND}: this head reads the target's visual embeddings; pass embeds=")
        image = head.config.image_token_id
        visual = ids[:, :-1] == image if image is not None else torch.zeros_like(valid)  # [B, L-1] x_i is visual
        extra = {"visual": embeds[:, :-1], "visual_mask": visual & batch.attention_mask[:, :-1].bool().to(dev)}
    pred = head(ids[:, 1:], h_in, pos, mask, **extra)  # [B, L-1, H] h^_{i+1}
    rows, cols = batch.rows.to(dev), batch.cols.to(dev)
    ph = pred[rows, cols].float()  # [M, H]
    th = hidden[rows, cols + 1]  # [M, H] h_{i+1}
    tok = ids[rows, cols + 2]  # [M] x_{i+2}
    logp = head.logits(ph).log_softmax(-1)  # [M, V]
    with torch.no_grad():
        tp = head.logits(th).softmax(-1)  # [M, V] the target's p at temperature 1
    feat = F.smooth_l1_loss(ph, th)
    hard = -logp.gather(1, tok[:, None]).mean()
    soft = -(tp * logp).sum(-1).mean()
    loss = feat + cfg.ce_weight * ((1 - cfg.soft) * hard + cfg.soft * soft)
    return {"loss": loss, "feat": feat, "hard": hard, "soft": soft,
            "agree": (logp.argmax(-1) == tok).float().mean()}


def eagle_step(head: EagleHead, model, batch: Batch, cfg: EagleTrainConfig,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The losses of one batch for an ``EagleHead`` (``fit``'s default ``step``): one frozen target forward, then
    ``losses``. Another recipe passes its own ``step(head, model, batch, cfg, generator)`` returning at least
    ``loss``, ``feat``, ``hard`` and ``agree``."""
    hidden, embeds = target_features(model, batch, cfg.device, head.reads_visual)
    return losses(head, hidden, batch, cfg, generator, embeds)


@torch.no_grad()
def evaluate(head: EagleHead, target, processor, answers: list[Answer], cfg: EagleTrainConfig,
             engine_n: int = 0, step: Callable | None = None, source=None) -> dict[str, float]:
    """Teacher-forced agreement / CE on held-out answers, and tau of greedy chain drafting on ``engine_n`` of them.
    ``step``: the recipe's batch losses (default ``eagle_step``); ``source``: where the answers' prompts come from
    (default the world)."""
    was = head.training
    head.eval()
    tot = {"feat": 0.0, "hard": 0.0, "agree": 0.0}
    n = 0
    plain = replace(cfg, noise=0.0)
    for group in token_budget_batches(answers, cfg.token_budget):
        batch = collate(group, processor, cfg.seed, processor.tokenizer.pad_token_id, source)
        m = len(batch.rows)
        if not m:
            continue
        parts = (step or eagle_step)(head, target.model, batch, plain)
        for k in tot:
            tot[k] += float(parts[k]) * m
        n += m
    res = {f"eval_{k}": round(v / max(n, 1), 4) for k, v in tot.items()}
    if engine_n:
        res["eval_tau_g4"] = round(engine_tau(head, target, processor, answers[:engine_n], cfg, source=source), 3)
    head.train(was)
    return res


def engine_tau(head: EagleHead, target, processor, answers: list[Answer], cfg: EagleTrainConfig,
               gamma: int = 4, source=None) -> float:
    """Mean accepted length of greedy chain drafting through the real engine (answers cut at max_new_tokens), with
    the head's own drafter kind (``head.KIND``)."""
    from specula.drafters import create
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.core.sampling import SamplingParams

    drafter = create({"kind": head.KIND, "head": head, "structure": "chain"}, target=target)
    eos = sorted(set(target.info.eos_token_ids) | {processor.tokenizer.eos_token_id})
    eng = SpecEngine(target, drafter, gamma=gamma, eos_token_ids=eos)
    params = SamplingParams(max_tokens=cfg.max_new_tokens)
    reqs = [prompt_of(processor, a, cfg.seed, source).request(f"e{i}", params) for i, a in enumerate(answers)]
    emitted = blocks = 0
    for i in range(0, len(reqs), 8):
        for r in eng.generate(reqs[i:i + 8]).values():
            emitted += r.metrics.accepted_tokens + r.metrics.blocks
            blocks += r.metrics.blocks
    return emitted / max(blocks, 1)


def lr_at(samples: int, cfg: EagleTrainConfig) -> float:
    return warmup_cosine(samples, cfg.warmup_samples, cfg.total_samples, cfg.lr)


# ------------------------------------------------------------------------------------------------------- training


@dataclass
class Run:
    """What a feature-level recipe opens before training: its folder, the processor, the frozen target."""

    dir: Path
    processor: object
    target: object  # a specula.targets Target, frozen
    fingerprint: str  # sha256 of the target's weights
    source: object = None  # where the prompts come from (training/data/sources.py; None = the world)
    start: int = 0  # first training prompt index of the source

    def answers(self, cfg: EagleTrainConfig, folder: Path, *, desc: str, log=print, split: str = "train",
                n: int | None = None, eval_n: int | None = None, key: dict | None = None) -> Path:
        """``make_answers`` for this run's source: ``n`` (default ``cfg.data_samples``) prompts of ``split`` and
        ``eval_n`` (default ``cfg.eval_samples``) held-out ones, each at most what a conversation file holds."""
        n = data_count(self.source, split, cfg.data_samples if n is None else n, log)
        eval_n = data_count(self.source, "eval", cfg.eval_samples if eval_n is None else eval_n, log)
        return make_answers(folder, self.target, self.processor,
                            key={**(key or cfg.data_key()), "target_sha256": self.fingerprint}, n=n, eval_n=eval_n,
                            start=self.start, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, chunk=cfg.chunk,
                            gen_batch=cfg.gen_batch, desc=desc, log=log, split=split, source=self.source,
                            answers=cfg.answers)


def open_run(cfg: EagleTrainConfig, log=print) -> Run:
    from specula.targets import load_target
    from specula.zoo.store import resolve

    torch.set_num_threads(cfg.threads)
    target_dir = resolve(cfg.target)
    processor = recipe_processor(cfg, target_dir)
    source = data_source(cfg, processor, log=log)  # a bad data file stops here, before anything is written
    target = load_target(target_dir, device=cfg.device)
    target.model.requires_grad_(False)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    return Run(run, processor, target, target_fingerprint(target_dir), source, data_start(cfg))


def new_head(head_cls: type[EagleHead], run: Run, cfg: EagleTrainConfig, **config) -> EagleHead:
    """A fresh head of ``head_cls`` sized from the target (``config`` overrides config fields), seeded with
    ``cfg.seed``, on the target's embedding and lm_head."""
    torch.manual_seed(cfg.seed)
    hcfg = replace(head_cls.CONFIG_CLS.from_target(run.target), **config)
    head = head_cls(hcfg).to(cfg.device)
    model = run.target.model
    return head.attach(model.get_input_embeddings(), model.get_output_embeddings())


def train(cfg: EagleTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make the answers (resumable), then train (resumable); returns the checkpoint folder. ``stop_at``: stop with a
    checkpoint once that many samples are done (a time-boxed or interrupted run; a rerun goes on from there)."""
    run = open_run(cfg, log)
    data_dir = run.answers(cfg, run.dir / "data", desc="eagle data", log=log)
    data = load_answers(data_dir, "train", data_count(run.source, "train", cfg.data_samples, lambda _m: None))
    held_out = load_answers(data_dir, "eval", data_count(run.source, "eval", cfg.eval_samples, lambda _m: None))
    head = new_head(EagleHead, run, cfg)
    perm: dict = {}
    return fit(cfg, run, head, lambda j: data[epoch_order(j, len(data), cfg.seed, perm)], held_out,
               log=log, stop_at=stop_at, about=f"{len(data)} answers")


def fit(cfg: EagleTrainConfig, run: Run, head: EagleHead, pick: Callable[[int], Answer], held_out: list[Answer],
        *, log=print, stop_at: int | None = None, about: str = "",
        status: Callable[[int], dict] | None = None, step: Callable | None = None) -> Path:
    """The resumable training loop of the feature-level recipes (module docstring, step 2-3) for any ``EagleHead``
    subclass; returns ``<run_dir>/ckpt``. ``pick(j)``: the j-th training sample, a pure function of j (so a resumed
    run sees the same batches); ``status(samples)``: extra fields for the progress bar and the state (e.g. the
    training stage); ``about``: what the run trains on, for the log; ``step``: the losses of one batch (default
    ``eagle_step``; any head with ``KIND``, ``CONFIG`` and a config with ``to_json`` trains here)."""
    step = step or eagle_step
    ckpt = run.dir / "ckpt"
    target, processor, model = run.target, run.processor, run.target.model
    pad = processor.tokenizer.pad_token_id
    hcfg = head.config
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg),
             "target_sha256": run.fingerprint, "params": sum(p.numel() for p in head.parameters())}
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())
        if old.get("target_sha256") != run.fingerprint:
            raise ValueError(f"{ckpt} was trained against another target; use another run_dir")
        if (ckpt / head.CONFIG).exists() and (ckpt / head.CONFIG).read_text() != hcfg.to_json():
            raise ValueError(f"{ckpt} holds a head with another config; use another run_dir")
        head.load_state_dict(load_file(ckpt / "head.safetensors", device=str(cfg.device)))
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=cfg.device))
        state.update({k: old[k] for k in ("samples", "steps", "elapsed_s", "history", "init_samples") if k in old})
        log(f"resumed from {ckpt}: {state['samples']} samples, {state['elapsed_s'] / 60:.1f} min")
    elif cfg.init_from:
        state["init_samples"] = lineage_samples(warm_start(head, cfg.init_from))
        log(f"warm start from {cfg.init_from} ({state['init_samples']} samples behind it)")
    log(f"{head.KIND} head: {state['params'] / 1e6:.2f} M params, {about}")

    def save() -> None:
        save_checkpoint(ckpt, "head.safetensors", {k: v.contiguous() for k, v in head.state_dict().items()}, opt,
                        state, {head.CONFIG: hcfg.to_json()})

    ema: dict[str, float] = {}

    def run_eval() -> None:
        if held_out:
            res = evaluate(head, target, processor, held_out, cfg, min(cfg.eval_engine, len(held_out)), step,
                           run.source)
            res.update(samples=state["samples"], minutes=round(state["elapsed_s"] / 60, 1),
                       **(status(state["samples"]) if status else {}),
                       **{f"loss_{k}": round(v, 4) for k, v in ema.items()})
            state["history"].append(res)
            log(json.dumps(res))

    head.train()
    bar = tqdm(total=cfg.total_samples, initial=state["samples"], unit="sample", desc=f"train {head.KIND}",
               mininterval=5.0)
    clock = Cadence(state, cfg.eval_every_s, cfg.ckpt_every_s)
    while state["samples"] < cfg.total_samples:
        if stop_at is not None and state["samples"] >= stop_at:
            break
        start = state["samples"]
        stop = min(start + cfg.pool, cfg.total_samples)
        items = [pick(j) for j in range(start, stop)]
        for group in token_budget_batches(items, cfg.token_budget):
            lr = lr_at(state["samples"], cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = collate(group, processor, cfg.seed, pad, run.source)
            if len(batch.rows):
                noise = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state["steps"])
                parts = step(head, model, batch, cfg, noise)
                opt.zero_grad(set_to_none=True)
                parts["loss"].backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
                opt.step()
                for k, v in parts.items():
                    x = float(v.detach())
                    ema[k] = 0.98 * ema.get(k, x) + 0.02 * x
            state["steps"] += 1
            state["samples"] += len(group)
            bar.update(len(group))
        bar.set_postfix({**(status(state["samples"]) if status else {}),
                         **{k: f"{v:.3f}" for k, v in ema.items()}}, refresh=False)
        clock.tick(run_eval, save)
    bar.close()
    if state["samples"] >= cfg.total_samples and (not state["history"]
                                                  or state["history"][-1].get("samples") != state["samples"]):
        run_eval()
    save()
    return ckpt


# ------------------------------------------------------------------------------------------------------- export


def export_eagle(ckpt: Path, out: Path = EAGLE_DIR) -> Path:
    """Checkpoint -> ``out``: fp16 ``eagle.safetensors`` + ``eagle_config.json`` + ``specula.json``. Rewrites the
    zoo manifest when ``out`` is in the zoo."""
    return export_head(ckpt, out, EagleHead)


def export_head(ckpt: Path, out: Path, head_cls: type[EagleHead], info: dict | None = None) -> Path:
    """``export_eagle`` for any head class (its files); ``info``: more fields for ``specula.json``."""
    from specula.zoo import store as manifest

    ckpt, out = Path(ckpt), Path(out)
    state = json.loads((ckpt / "state.json").read_text())
    cfg = head_cls.CONFIG_CLS.from_json((ckpt / head_cls.CONFIG).read_text())
    head = head_cls(cfg)
    head.load_state_dict(load_file(ckpt / "head.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    save_head(head, out, torch.float16)
    last = state["history"][-1] if state["history"] else {}
    meta = {
        "kind": head_cls.KIND, "params": sum(p.numel() for p in head.parameters()), "target": sibling_ref(state["config"]["target"], out),
        "target_sha256": state["target_sha256"], "data_samples": state["config"]["data_samples"],
        "trained_samples": state["samples"], "train_minutes": round(state["elapsed_s"] / 60, 1),
        "device": state["config"].get("device", "cpu"),  # what train_minutes were measured on
        "eval_tau_g4": last.get("eval_tau_g4"), "init_from": state["config"].get("init_from") or None,
        "init_samples": state.get("init_samples", 0),
        **(info or {}), "history": state["history"],
        "storage_dtype": "float16",
    }
    (out / "specula.json").write_text(json.dumps(meta, indent=1) + "\n")
    if out.resolve().parent == ZOO_DIR.resolve():
        manifest.write(out.parent)
    return out


def train_eagle_cli(args) -> int:
    """``specula train eagle``: args run_dir, target, data_samples, samples, max_new_tokens, seed, threads, device,
    ckpt_every, eval_every, export (bool), out (None = zoo/weights/eagle)."""
    ckpt = train(EagleTrainConfig(**common_cli_config(args)))
    if args.export:
        print(f"exported to {export_eagle(ckpt, Path(args.out) if args.out else EAGLE_DIR)}")
    return 0


def common_cli_config(args) -> dict:
    """The train config fields set by ``specula train``'s shared recipe arguments (``cli._distill_args``)."""
    return dict(run_dir=args.run_dir, target=args.target, data_samples=args.data_samples, total_samples=args.samples,
                max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads, device=args.device,
                ckpt_every_s=args.ckpt_every, eval_every_s=args.eval_every,
                init_from=getattr(args, "init_from", None) or "", **data_cli_config(args))


def data_cli_config(args) -> dict:
    """The config's data fields from ``--data``, ``--image-root`` and ``--answers`` (``commands._distill_args``)."""
    return dict(data_file=getattr(args, "data", None) or "", image_root=getattr(args, "image_root", None) or "",
                answers=getattr(args, "answers", None) or "target")
