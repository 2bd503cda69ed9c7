"""``specula train aasd``: the AASD draft layer and KV projector, trained with Target-Draft Attention (sec. 3.3).

Data (``training/drafters/distill_data.py``, resumable): the target's own greedy answers to ``data_samples`` prompts of the
world's training mix and ``eval_samples`` held-out prompts, as ``eagle`` (``data_dir`` may share another recipe's).

Target-Draft Attention. At inference the token at position t of a chain that started at s (the pending token)
attends the target's last-layer K/V of positions < s (images compressed) and the draft's own k'/v' of s .. t
(eq. 11-13). With one draft layer, q'_t, k'_t and v'_t depend only on (x_t, t), not on s, so one target forward
(its cache gives K, V of the whole prompt + answer) and, per chain depth j = 1 .. ``train_depth``, one draft forward
whose mask lets query t see the target's entries before s = t - j + 1 and its own entries s .. t reproduce every
drafting step exactly, for every start and depth at once (teacher forcing: the chain's tokens are the target's
own answer, i.e. the drafts greedy acceptance keeps). The precompute-and-index of the paper, as masks.

Loss at every answer position t (x_{t+1} an answer token, not the first) and depth j with s >= the first answer
position (a chain starts at a pending token, after the prompt):

    SmoothL1(h^_t, h_t) + ce_weight * ((1 - soft) * CE(lm_head(h^_t), x_{t+1}) + soft * CE(.., softmax(lm_head(h_t))))

averaged over all (t, j); h_t is the target's final-norm hidden state (what its lm_head reads). The paper names no
loss; this is ``eagle``'s (feature regression + cross-entropy on the target's token and distribution), since the
draft's output lives in the same space. ``noise`` is unused (the draft reads no feature).

The head starts from the target's last decoder layer and final norm (``init_from_target``) and pooling W_K / W_V.
Loop, checkpoints (resumable, exact), evaluation (held-out agreement at depth 1 and the real chain tau, gamma 4)
and export are ``eagle``'s (``train_eagle.fit`` with ``aasd_step``).

    cfg = AasdTrainConfig(run_dir="runs/aasd", target="target")
    export_aasd(train(cfg), out=Path("zoo/weights/aasd"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specula.drafters.aasd_head import AasdHead, context_kv
from specula.training.drafters.common import data_count
from specula.training.drafters.distill_data import load_answers
from specula.training.drafters.eagle import (Batch, EagleTrainConfig, common_cli_config, epoch_order, export_head, fit,
                                         new_head, open_run, vision_kwargs)
from specula.targets.kv import attention_mask
from specula.zoo.store import ZOO_DIR

AASD_DIR = ZOO_DIR / "aasd"


@dataclass(frozen=True)
class AasdTrainConfig(EagleTrainConfig):
    """``EagleTrainConfig`` (``noise`` unused) plus the KV projector's size and the TDA chain depth."""

    run_dir: str = "runs/aasd"
    kv_tokens: int = 64  # k compressed entries per image (the paper: 64)
    train_depth: int = 5  # chain depths trained per position (inference gamma up to this is trained exactly)
    init_from_target: bool = True  # start from the target's last layer and final norm
    data_dir: str | None = None  # where the answers live (default <run_dir>/data)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_tokens", "train_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AasdTrainConfig.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.init_from_target, bool):
            raise ValueError(f"AasdTrainConfig.init_from_target must be a bool, got {self.init_from_target!r}")


@torch.no_grad()
def target_kv(model, batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen target forward: final-norm hidden states [B, L, H] fp32 and its last layer's cached keys / values
    [B, H_kv, L, D] (post-RoPE, what the HF target's cache holds)."""
    out = model.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                      use_cache=True, **vision_kwargs(model, batch, device))
    layer = out.past_key_values.layers[-1]
    return out.last_hidden_state.float(), layer.keys, layer.values


def context_batch(head: AasdHead, ids: torch.Tensor, lengths: list[int], K: torch.Tensor, V: torch.Tensor):
    """The draft contexts of a batch: ids [B, L], K/V [B, H_kv, L, D] (the target's last layer) -> kc, vc [B, H_kv,
    S, D] (images compressed, right-padded; grad flows to W_K / W_V) and src [B, S] int64, the source position of
    each entry (padding: L, never visible)."""
    p = head.norm.weight
    b, seq = ids.shape
    ctx = [context_kv(head, ids[r, :n], K[r, :, :n].to(p.dtype), V[r, :, :n].to(p.dtype))
           for r, n in enumerate(lengths)]  # each (k, v [H_kv, S_r, D], source positions [S_r])
    s_ctx = max(k.shape[1] for k, _, _ in ctx)
    kc, vc = [], []
    src = torch.full((b, s_ctx), seq, dtype=torch.long, device=ids.device)  # [B, S]
    for r, (k, v, s) in enumerate(ctx):
        pad = s_ctx - k.shape[1]
        kc.append(F.pad(k, (0, 0, 0, pad)))
        vc.append(F.pad(v, (0, 0, 0, pad)))
        src[r, : len(s)] = s.to(ids.device)
    return torch.stack(kc), torch.stack(vc), src


def tda_hidden(head: AasdHead, ids: torch.Tensor, valid: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               src: torch.Tensor, depth: int) -> torch.Tensor:
    """Target-Draft Attention at chain depth j = ``depth``: the draft's output at every position t as if a chain
    had started at s = t - j + 1 (the target's entries from before s, its own from s .. t). ids/valid [B, L],
    kc/vc/src from ``context_batch``. Returns h^ [B, L, H]."""
    b, seq = ids.shape
    dev = ids.device
    pos = torch.arange(seq, device=dev)
    start = pos - depth + 1  # [L] chain start of each query
    see_ctx = src[:, None, :] < start[None, :, None]  # [B, L, S] the target's entries before the chain
    own = (pos[None, :] >= start[:, None]) & (pos[None, :] <= pos[:, None])  # [L, L] the chain's own s .. t
    see_own = (own[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool, device=dev)[None]  # [B, L, L]
    allowed = torch.cat([see_ctx, see_own], dim=2)[:, None]  # [B, 1, L, S + L]
    cache = DynamicCache(config=head.llama_config)
    cache.update(kc, vc, 0)
    mask = attention_mask(allowed, head.llama_config._attn_implementation, head.norm.weight.dtype)
    return head(ids, pos.expand(b, -1), mask, cache)  # [B, L, H]


def aasd_step(head: AasdHead, model, batch: Batch, cfg: EagleTrainConfig,
              generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The TDA losses of one batch (module docstring): loss, feat, hard, soft, agree (all depths), agree1 (depth 1)."""
    hidden, K, V = target_kv(model, batch, cfg.device)
    dev = hidden.device
    b, seq, _ = hidden.shape
    ids = batch.input_ids.to(dev)
    valid = batch.attention_mask.bool().to(dev)  # [B, L]
    kc, vc, src = context_batch(head, ids, batch.attention_mask.sum(1).tolist(), K, V)
    rows, cols = batch.rows.to(dev), batch.cols.to(dev)
    t = cols + 1  # [M] query positions: x_t drafts x_{t+1}, an answer token after the first
    first = torch.full((b,), seq, dtype=torch.long, device=dev).scatter_reduce(0, rows, t, "amin")  # [B] answer start
    preds, targets, toks, depth = [], [], [], []
    for j in range(1, cfg.train_depth + 1):
        h = tda_hidden(head, ids, valid, kc, vc, src, j)  # [B, L, H]
        keep = t - j + 1 >= first[rows]  # [M] the chain starts at or after the first answer token
        preds.append(h[rows[keep], t[keep]])
        targets.append(hidden[rows[keep], t[keep]])
        toks.append(ids[rows[keep], t[keep] + 1])
        depth.append(torch.full((int(keep.sum()),), j, device=dev))
    ph, th, tok, depth = torch.cat(preds).float(), torch.cat(targets), torch.cat(toks), torch.cat(depth)
    logp = head.logits(ph).log_softmax(-1)  # [M', V]
    with torch.no_grad():
        tp = head.logits(th).softmax(-1)  # [M', V] the target's p at temperature 1
    feat = F.smooth_l1_loss(ph, th)
    hard = -logp.gather(1, tok[:, None]).mean()
    soft = -(tp * logp).sum(-1).mean()
    loss = feat + cfg.ce_weight * ((1 - cfg.soft) * hard + cfg.soft * soft)
    hit = logp.argmax(-1) == tok
    return {"loss": loss, "feat": feat, "hard": hard, "soft": soft, "agree": hit.float().mean(),
            "agree1": hit[depth == 1].float().mean()}


def train(cfg: AasdTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make the answers (resumable), then train (resumable); returns the checkpoint folder. ``stop_at``: stop with a
    checkpoint once that many samples are done."""
    run = open_run(cfg, log)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else run.dir / "data"
    run.answers(cfg, data_dir, desc="aasd data", log=log)
    data = load_answers(data_dir, "train", data_count(run.source, "train", cfg.data_samples, lambda _m: None))
    held_out = load_answers(data_dir, "eval", data_count(run.source, "eval", cfg.eval_samples, lambda _m: None))
    head = new_head(AasdHead, run, cfg, kv_tokens=cfg.kv_tokens)
    if cfg.init_from_target:
        head.init_from_target(run.target.model)
    perm: dict = {}
    about = f"{len(data)} answers, {head.w_k.shape[0]} KV entries per image, TDA depth {cfg.train_depth}"
    return fit(cfg, run, head, lambda j: data[epoch_order(j, len(data), cfg.seed, perm)], held_out, log=log,
               stop_at=stop_at, about=about, step=aasd_step)


def export_aasd(ckpt: Path, out: Path = AASD_DIR) -> Path:
    """Checkpoint -> ``out``: fp16 ``aasd.safetensors`` + ``aasd_config.json`` + ``specula.json``. Rewrites the zoo
    manifest when ``out`` is in the zoo."""
    import json

    c = json.loads((Path(ckpt) / "state.json").read_text())["config"]
    return export_head(ckpt, out, AasdHead, {"kv_tokens": c.get("kv_tokens"), "train_depth": c.get("train_depth")})


def train_aasd_cli(args) -> int:
    """``specula train aasd``: the shared recipe args (``cli._distill_args``) plus kv_tokens, train_depth, data_dir
    (None = <run_dir>/data)."""
    cfg = AasdTrainConfig(**common_cli_config(args), kv_tokens=args.kv_tokens, train_depth=args.train_depth,
                          data_dir=args.data_dir)
    ckpt = train(cfg)
    if args.export:
        print(f"exported to {export_aasd(ckpt, Path(args.out) if args.out else AASD_DIR)}")
    return 0
