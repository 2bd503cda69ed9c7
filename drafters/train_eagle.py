"""``specula train eagle``: train the EAGLE head on the target's own answers and hidden states.

Recipe (EAGLE-1, Li et al. 2024, as the MSD paper's feature-level baseline):

1. Data (``drafters/distill_data.py``, resumable): the target answers ``data_samples`` world training prompts
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

    cfg = EagleTrainConfig(run_dir="runs/eagle", target="target")
    export_eagle(train(cfg), out=Path("zoo/weights/eagle"))
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specula.drafters.distill_data import Answer, load_answers, make_answers, pixels, target_fingerprint
from specula.drafters.eagle_head import EagleConfig, EagleHead, head_parameters, save_head
from specula.zoo.paths import TOKENIZER_DIR, ZOO_DIR

EAGLE_DIR = ZOO_DIR / "eagle"


@dataclass(frozen=True)
class EagleTrainConfig:
    run_dir: str = "runs/eagle"
    target: str = "target"  # zoo name or directory of the target
    tokenizer_dir: str = str(TOKENIZER_DIR)  # processor: tokenizer + image processor
    # data
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

    def __post_init__(self) -> None:
        for name in ("data_samples", "max_new_tokens", "chunk", "gen_batch", "total_samples", "pool", "token_budget",
                     "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EagleTrainConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("data_start", "eval_samples", "warmup_samples", "seed", "eval_engine"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"EagleTrainConfig.{name} must be an integer >= 0, got {v!r}")
        if self.eval_engine > self.eval_samples:
            raise ValueError("EagleTrainConfig.eval_engine must be <= eval_samples")
        for name in ("lr", "ckpt_every_s", "eval_every_s", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"EagleTrainConfig.{name} must be > 0, got {v!r}")
        for name in ("weight_decay", "ce_weight", "noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"EagleTrainConfig.{name} must be >= 0, got {v!r}")
        if not 0.0 <= self.soft <= 1.0:
            raise ValueError(f"EagleTrainConfig.soft must be in [0, 1], got {self.soft!r}")

    def data_key(self) -> dict:
        """What defines the cached answers besides the target's weights."""
        return {"target": self.target}


# ------------------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, prompt then answer, right-padded
    attention_mask: torch.Tensor  # [B, L] int64
    pixel_values: torch.Tensor | None  # [N_img, 3, S, S] the rows' images in order
    rows: torch.Tensor  # [M] int64, row of each scored position
    cols: torch.Tensor  # [M] int64, pair index i (the head's output there drafts x_{i+2})


def collate(items: list[Answer], processor, seed: int, pad_id: int) -> Batch:
    seqs = [torch.cat([a.prompt, a.response]) for a in items]
    ids = torch.full((len(items), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, pix = [], [], []
    for b, (a, s) in enumerate(zip(items, seqs)):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
        lp, n = len(a.prompt), len(s)
        rows.append(torch.full((max(n - lp - 1, 0),), b, dtype=torch.long))
        cols.append(torch.arange(lp - 1, n - 2))
        p = pixels(processor, a, seed)
        if p is not None:
            pix.append(p)
    return Batch(ids, mask, torch.cat(pix) if pix else None, torch.cat(rows), torch.cat(cols))


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
    pix = batch.pixel_values.to(device, next(model.parameters()).dtype) if batch.pixel_values is not None else None
    out = model.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                      pixel_values=pix)
    return out.last_hidden_state.float()


def losses(head: EagleHead, hidden: torch.Tensor, batch: Batch, cfg: EagleTrainConfig,
           generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """One teacher-forced pass of the head over every sequence of the batch (module docstring).

    hidden [B, L, H] fp32 target features; returns the total ``loss`` and its parts (feat, hard, soft, agree).
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
    pred = head(ids[:, 1:], h_in, pos, mask)  # [B, L-1, H] h^_{i+1}
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


@torch.no_grad()
def evaluate(head: EagleHead, target, processor, answers: list[Answer], cfg: EagleTrainConfig,
             engine_n: int = 0) -> dict[str, float]:
    """Teacher-forced agreement / CE on held-out answers, and tau of greedy chain drafting on ``engine_n`` of them."""
    was = head.training
    head.eval()
    tot = {"feat": 0.0, "hard": 0.0, "agree": 0.0}
    n = 0
    plain = EagleTrainConfig(**{**asdict(cfg), "noise": 0.0})
    for group in token_budget_batches(answers, cfg.token_budget):
        batch = collate(group, processor, cfg.seed, processor.tokenizer.pad_token_id)
        m = len(batch.rows)
        if not m:
            continue
        parts = losses(head, target_hidden(target.model, batch, cfg.device), batch, plain)
        for k in tot:
            tot[k] += float(parts[k]) * m
        n += m
    res = {f"eval_{k}": round(v / max(n, 1), 4) for k, v in tot.items()}
    if engine_n:
        res["eval_tau_g4"] = round(engine_tau(head, target, processor, answers[:engine_n], cfg), 3)
    head.train(was)
    return res


def engine_tau(head: EagleHead, target, processor, answers: list[Answer], cfg: EagleTrainConfig,
               gamma: int = 4) -> float:
    """Mean accepted length of greedy chain drafting through the real engine (answers cut at max_new_tokens)."""
    from specula.drafters.eagle import EagleDrafter
    from specula.runtime.engine import GenerationRequest, SpecEngine
    from specula.runtime.sampling import SamplingParams

    drafter = EagleDrafter(head=head, structure="chain", target=target)
    eng = SpecEngine(target, drafter, gamma=gamma, eos_token_ids=[processor.tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=cfg.max_new_tokens)
    reqs = [GenerationRequest(f"e{i}", a.prompt, pixels(processor, a, cfg.seed), params)
            for i, a in enumerate(answers)]
    emitted = blocks = 0
    for i in range(0, len(reqs), 8):
        for r in eng.generate(reqs[i:i + 8]).values():
            emitted += r.metrics.accepted_tokens + r.metrics.blocks
            blocks += r.metrics.blocks
    return emitted / max(blocks, 1)


def lr_at(samples: int, cfg: EagleTrainConfig) -> float:
    if samples < cfg.warmup_samples:
        return cfg.lr * max(samples, 1) / cfg.warmup_samples
    frac = min(1.0, (samples - cfg.warmup_samples) / max(1, cfg.total_samples - cfg.warmup_samples))
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def _order(j: int, n: int, seed: int, cache: dict) -> int:
    """Data index of the j-th training sample: epochs in a seeded order."""
    epoch = j // n
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return cache[epoch][j % n]


# ------------------------------------------------------------------------------------------------------- training


def train(cfg: EagleTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make the answers (resumable), then train (resumable); returns the checkpoint folder. ``stop_at``: stop with a
    checkpoint once that many samples are done (a time-boxed or interrupted run; a rerun goes on from there)."""
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.paths import resolve

    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    processor = load_processor(cfg.tokenizer_dir)
    pad = processor.tokenizer.pad_token_id
    target_dir = resolve(cfg.target)
    target = load_target(target_dir, device=cfg.device)
    target.model.requires_grad_(False)
    fingerprint = target_fingerprint(target_dir)
    data_dir = make_answers(run / "data", target, processor, key={**cfg.data_key(), "target_sha256": fingerprint},
                            n=cfg.data_samples, eval_n=cfg.eval_samples, start=cfg.data_start, seed=cfg.seed,
                            max_new_tokens=cfg.max_new_tokens, chunk=cfg.chunk, gen_batch=cfg.gen_batch,
                            desc="eagle data", log=log)
    data = load_answers(data_dir, "train", cfg.data_samples)
    held_out = load_answers(data_dir, "eval", cfg.eval_samples) if cfg.eval_samples else []

    torch.manual_seed(cfg.seed)
    hcfg = EagleConfig.from_target(target)
    head = EagleHead(hcfg).to(cfg.device)
    model = target.model
    head.attach(model.get_input_embeddings(), model.get_output_embeddings())
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg),
             "target_sha256": fingerprint, "params": head_parameters(hcfg)}
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())
        if old.get("target_sha256") != fingerprint:
            raise ValueError(f"{ckpt} was trained against another target; use another run_dir")
        head.load_state_dict(load_file(ckpt / "head.safetensors", device=str(cfg.device)))
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=cfg.device))
        state.update({k: old[k] for k in ("samples", "steps", "elapsed_s", "history")})
        log(f"resumed from {ckpt}: {state['samples']} samples, {state['elapsed_s'] / 60:.1f} min")
    log(f"eagle head: {state['params'] / 1e6:.2f} M params, {len(data)} answers")

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, tmp / "head.safetensors")
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        (tmp / "eagle_config.json").write_text(hcfg.to_json())
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        ckpt.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            f.replace(ckpt / f.name)
        tmp.rmdir()

    ema: dict[str, float] = {}

    def run_eval() -> None:
        if held_out:
            res = evaluate(head, target, processor, held_out, cfg, cfg.eval_engine)
            res.update(samples=state["samples"], minutes=round(state["elapsed_s"] / 60, 1),
                       **{f"loss_{k}": round(v, 4) for k, v in ema.items()})
            state["history"].append(res)
            log(json.dumps(res))

    head.train()
    perm: dict = {}
    bar = tqdm(total=cfg.total_samples, initial=state["samples"], unit="sample", desc="train eagle",
               mininterval=5.0)
    t_last = last_ckpt = last_eval = time.time()
    while state["samples"] < cfg.total_samples:
        if stop_at is not None and state["samples"] >= stop_at:
            break
        start = state["samples"]
        stop = min(start + cfg.pool, cfg.total_samples)
        items = [data[_order(j, len(data), cfg.seed, perm)] for j in range(start, stop)]
        for group in token_budget_batches(items, cfg.token_budget):
            lr = lr_at(state["samples"], cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = collate(group, processor, cfg.seed, pad)
            if len(batch.rows):
                noise = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state["steps"])
                parts = losses(head, target_hidden(model, batch, cfg.device), batch, cfg, noise)
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
        now = time.time()
        state["elapsed_s"] += now - t_last
        t_last = now
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if now - last_eval > cfg.eval_every_s:
            run_eval()
            last_eval = t_last = time.time()
        if now - last_ckpt > cfg.ckpt_every_s:
            save()
            last_ckpt = time.time()
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
    from specula.zoo import manifest

    ckpt, out = Path(ckpt), Path(out)
    state = json.loads((ckpt / "state.json").read_text())
    cfg = EagleConfig.from_json((ckpt / "eagle_config.json").read_text())
    head = EagleHead(cfg)
    head.load_state_dict(load_file(ckpt / "head.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    save_head(head, out, torch.float16)
    last = state["history"][-1] if state["history"] else {}
    info = {
        "kind": "eagle", "params": head_parameters(cfg), "target": state["config"]["target"],
        "target_sha256": state["target_sha256"], "data_samples": state["config"]["data_samples"],
        "trained_samples": state["samples"], "train_minutes": round(state["elapsed_s"] / 60, 1),
        "eval_tau_g4": last.get("eval_tau_g4"), "history": state["history"], "storage_dtype": "float16",
    }
    (out / "specula.json").write_text(json.dumps(info, indent=1) + "\n")
    if out.resolve().parent == ZOO_DIR.resolve():
        manifest.write(out.parent)
    return out


def train_eagle_cli(args) -> int:
    """``specula train eagle``: args run_dir, target, data_samples, samples, max_new_tokens, seed, threads, device,
    ckpt_every, eval_every, export (bool), out (None = zoo/weights/eagle)."""
    cfg = EagleTrainConfig(run_dir=args.run_dir, target=args.target, data_samples=args.data_samples,
                           total_samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed,
                           threads=args.threads, device=args.device, ckpt_every_s=args.ckpt_every,
                           eval_every_s=args.eval_every)
    ckpt = train(cfg)
    if args.export:
        print(f"exported to {export_eagle(ckpt, Path(args.out) if args.out else EAGLE_DIR)}")
    return 0
