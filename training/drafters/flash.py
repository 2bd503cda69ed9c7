"""``specula train flash``: the FLASH head (latent visual compression + semi-autoregressive k-token head).

Data (``training/drafters/distill_data.py``, resumable): the target's own greedy answers to ``data_samples`` prompts of the
world's training mix (images and text, as ``eagle``) and ``eval_samples`` held-out prompts of the evaluation
suites; ``data_dir`` may point at another recipe's answers of the same target (e.g. ``runs/eagle/data``).

Training, teacher-forced over whole sequences (FLASH sec. 3.3): per batch the frozen target runs once over prompt +
answer and gives its final-norm hidden states h_i and the input embeddings its LM read (projected visual
embeddings at image tokens). The head builds the draft sequence (EAGLE pairs (h_i + noise, x_{i+1}) at text
positions, each image compressed to m latent tokens), runs its layer once, causal, and at every answer pair i
(the same positions ``eagle`` scores) its k offsets predict h_{i+1} .. h_{i+k}; for each offset j whose target
token x_{i+j+1} exists:

    SmoothL1(h^_{i+j}, h_{i+j}) + ce_weight * ((1 - soft) * CE(lm_head(h^_{i+j}), x_{i+j+1})
                                               + soft * CE(lm_head(h^_{i+j}), softmax(lm_head(h_{i+j}))))

averaged over all (i, j) (eq. 4-6: the feature regression plus lambda times the cross-entropy against the target;
the paper's lambda is not legible in our copy, we keep ``eagle``'s 0.1 and its hard/soft split). The next pair is
always the target's own (teacher forcing: "the next token predicted by the target model is appended").

The loop, checkpoints (resumable, exact), evaluation (teacher-forced agreement over all k offsets and the real tau
of chain drafting, gamma 4) and export are ``eagle``'s (``train_eagle.fit`` with ``flash_step``).
``export_flash``: fp16 ``flash.safetensors`` + ``flash_config.json`` + ``specula.json``.

    cfg = FlashTrainConfig(run_dir="runs/flash", target="target")
    export_flash(train(cfg), out=Path("zoo/weights/flash"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specula.training.drafters.common import data_count
from specula.training.drafters.distill_data import load_answers
from specula.drafters.flash_head import FlashHead, draft_inputs, layout
from specula.drafters.image_runs import image_lengths
from specula.training.drafters.eagle import (Batch, EagleTrainConfig, common_cli_config, epoch_order, export_head, fit,
                                         new_head, open_run, target_features)
from specula.zoo.store import ZOO_DIR

FLASH_DIR = ZOO_DIR / "flash"


@dataclass(frozen=True)
class FlashTrainConfig(EagleTrainConfig):
    """``EagleTrainConfig`` plus the head's k and m."""

    run_dir: str = "runs/flash"
    tokens_per_pass: int = 4  # k (the paper: 4; 6 gains little)
    visual_tokens: int = 64  # m per image (capped at the target's tokens per image)
    data_dir: str | None = None  # where the answers live (default <run_dir>/data)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tokens_per_pass", "visual_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FlashTrainConfig.{name} must be an integer >= 1, got {v!r}")


def flash_step(head: FlashHead, model, batch: Batch, cfg: EagleTrainConfig,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The losses of one batch (module docstring): loss, feat, hard, soft, agree (top-1 over all offsets), agree1
    (the first offset)."""
    hidden, embeds = target_features(model, batch, cfg.device, embeds=True)  # [B, L, H] fp32 each
    dev = hidden.device
    b, seq, H = hidden.shape
    hc = head.config
    ids = batch.input_ids.to(dev)  # [B, L]
    lengths = batch.attention_mask.sum(1).tolist()
    h_in = hidden[:, :-1]  # [B, L-1, H] h_i
    if cfg.noise > 0:
        u = torch.rand(h_in.shape, generator=generator, device=generator.device if generator is not None else "cpu")
        h_in = h_in + (u.to(dev) - 0.5) * cfg.noise
    pairs = head.pair_inputs(ids[:, 1:], h_in)  # [B, L-1, H]
    image = hc.image_token_id
    comp = None
    if image is not None:
        images = []  # every image of the batch in order, its own [T_img, H] embeddings
        for r, n in enumerate(lengths):
            try:
                t_img = image_lengths(ids[r, :n], image, hc.image_tokens)  # fixed T (LLaVA) or one per run
            except ValueError as e:
                raise ValueError(f"flash: the batch's image tokens are not whole images: {e}") from None
            if t_img:
                images += per_image_rows(embeds[r, :n][ids[r, :n] == image], t_img)
        if images:
            comp = head.compress_images(images)  # [sum m_img, H] every image's latent tokens, in order
    seqs, slots, used = [], torch.full((b, seq - 1), -1, dtype=torch.long), 0
    for r, n in enumerate(lengths):
        lay = layout(ids[r, : n - 1], image, hc.image_tokens, hc.visual_tokens)
        k_lat = sum(lay.latents)
        seqs.append(draft_inputs(head, pairs[r, : n - 1], comp[used:used + k_lat] if k_lat else None, lay))
        used += k_lat
        slots[r, lay.text_pos] = lay.text_slot
    if comp is not None and used != comp.shape[0]:
        raise ValueError("flash: an image token ends a sequence (no pair reads it)")
    width = max(len(s) for s in seqs)
    x = pairs.new_zeros(b, width, H)  # [B, L', H]
    for r, s in enumerate(seqs):
        x[r, : len(s)] = s
    valid = torch.arange(width, device=dev)[None, :] < torch.tensor([len(s) for s in seqs], device=dev)[:, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=dev)[None]
    from specula.targets.kv import attention_mask

    mask = attention_mask(allowed[:, None], head.llama_config._attn_implementation, head.fc.weight.dtype)
    o = head.decode(x, torch.arange(width, device=dev).expand(b, -1), mask)  # [B, L', H]
    rows, cols = batch.rows.to(dev), batch.cols.to(dev)  # pair i: its offsets predict h_{i+1} .. h_{i+k}
    d = slots.to(dev)[rows, cols]  # [M] draft index of pair i
    feats = head.expand(o[rows, d])  # [M, k, H]
    k = feats.shape[1]
    tgt = cols[:, None] + 1 + torch.arange(k, device=dev)[None]  # [M, k] index of h_{i+j}
    ok = tgt + 1 <= torch.tensor(lengths, device=dev)[rows][:, None] - 1  # [M, k] x_{i+j+1} exists
    tgt = tgt.clamp(max=seq - 2)
    ph = feats[ok].float()  # [M', H]
    th = hidden[rows[:, None].expand(-1, k), tgt][ok]  # [M', H]
    tok = ids[rows[:, None].expand(-1, k), tgt + 1][ok]  # [M'] x_{i+j+1}
    logp = head.logits(ph).log_softmax(-1)  # [M', V]
    with torch.no_grad():
        tp = head.logits(th).softmax(-1)  # [M', V] the target's p at temperature 1
    feat = F.smooth_l1_loss(ph, th)
    hard = -logp.gather(1, tok[:, None]).mean()
    soft = -(tp * logp).sum(-1).mean()
    loss = feat + cfg.ce_weight * ((1 - cfg.soft) * hard + cfg.soft * soft)
    hit = logp.argmax(-1) == tok  # [M']
    first = torch.zeros_like(ok)
    first[:, 0] = True
    return {"loss": loss, "feat": feat, "hard": hard, "soft": soft, "agree": hit.float().mean(),
            "agree1": hit[first[ok]].float().mean()}


def per_image_rows(rows: torch.Tensor, lengths) -> list[torch.Tensor]:
    """A row's image-token embeddings in order [sum T_img, H] -> one [T_img, H] per image."""
    return list(rows.split(list(lengths)))


def train(cfg: FlashTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make the answers (resumable), then train (resumable); returns the checkpoint folder. ``stop_at``: stop with a
    checkpoint once that many samples are done."""
    run = open_run(cfg, log)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else run.dir / "data"
    run.answers(cfg, data_dir, desc="flash data", log=log)
    data = load_answers(data_dir, "train", data_count(run.source, "train", cfg.data_samples, lambda _m: None))
    held_out = load_answers(data_dir, "eval", data_count(run.source, "eval", cfg.eval_samples, lambda _m: None))
    t = getattr(run.target.model.config, "image_seq_length", None)
    m = cfg.visual_tokens if t is None else min(cfg.visual_tokens, int(t))
    head = new_head(FlashHead, run, cfg, tokens_per_pass=cfg.tokens_per_pass, visual_tokens=m)
    perm: dict = {}
    return fit(cfg, run, head, lambda j: data[epoch_order(j, len(data), cfg.seed, perm)], held_out, log=log,
               stop_at=stop_at, about=f"{len(data)} answers, k = {cfg.tokens_per_pass}, {m} visual tokens per image",
               step=flash_step)


def export_flash(ckpt: Path, out: Path = FLASH_DIR) -> Path:
    """Checkpoint -> ``out``: fp16 ``flash.safetensors`` + ``flash_config.json`` + ``specula.json``. Rewrites the
    zoo manifest when ``out`` is in the zoo."""
    from specula.drafters.flash_head import FlashConfig

    cfg = FlashConfig.from_json((Path(ckpt) / FlashHead.CONFIG).read_text())
    return export_head(ckpt, out, FlashHead, {"tokens_per_pass": cfg.tokens_per_pass,
                                              "visual_tokens": cfg.visual_tokens, "image_tokens": cfg.image_tokens})


def train_flash_cli(args) -> int:
    """``specula train flash``: the shared recipe args (``cli._distill_args``) plus tokens_per_pass, visual_tokens,
    data_dir (None = <run_dir>/data)."""
    cfg = FlashTrainConfig(**common_cli_config(args), tokens_per_pass=args.tokens_per_pass,
                           visual_tokens=args.visual_tokens, data_dir=args.data_dir)
    ckpt = train(cfg)
    if args.export:
        print(f"exported to {export_flash(ckpt, Path(args.out) if args.out else FLASH_DIR)}")
    return 0
