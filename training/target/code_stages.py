"""The word-code stages of ``specula train target`` (``training/target/word_codes.py`` says what a code is and why).

- ``code_lm_stage``: the LM alone learns the world with each image token replaced by its patch's code. Optionally
  only the first ``code_lm_layers`` decoder layers run (a shallow LM learns the lookup several times faster per
  second); at the end the remaining layers are made identities (``o_proj`` and ``down_proj`` zeroed) so that the
  full-depth model computes exactly what the shallow one learnt, and the joint stage trains them from there.
- ``code_vision_loss``: tower + projector regress the codes (used by the vision stage and, as ``aux_in``, by the
  joint stage).
- ``code_answers`` / ``code_answer_hits``: held-out answers or captions with codes (or zero codes: the "blank
  image") in place of the image; the hits are the stage's image-vs-blank check, the captions ``zoo eval --codes``'.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specula.training.target.batching import Batch, collate, token_budget_batches
from specula.training.target.quality import normalize
from specula.training.target.referents import eager_attention, referent_attention_loss
from specula.training.target.word_codes import WordCodes

CODE_STREAM = 1 << 40  # the code LM stage's samples are indexed apart from the joint stage's


@contextlib.contextmanager
def shallow(lm, layers: int):
    """Run only the first ``layers`` decoder layers of a HF Llama-style model inside the block (0 = all)."""
    full = lm.config.num_hidden_layers
    if layers <= 0 or layers >= full:
        yield
        return
    lm.config.num_hidden_layers = layers
    try:
        yield
    finally:
        lm.config.num_hidden_layers = full


def make_identity(lm, first: int) -> int:
    """Zero the residual outputs of decoder layers ``first..`` so each adds nothing; returns how many changed."""
    n = 0
    with torch.no_grad():
        for layer in lm.layers[first:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            n += 1
    return n


def code_embeds(model, input_ids: torch.Tensor, codes: torch.Tensor | None) -> torch.Tensor:
    """Token embeddings with the image positions replaced by ``codes``.

    input_ids # [B, L]; codes # [N_img, T, H] in image order (None: no images)  ->  [B, L, H]
    """
    emb = model.get_input_embeddings()(input_ids)
    if codes is None:
        return emb
    mask = (input_ids == model.config.image_token_id).unsqueeze(-1)  # [B, L, 1]
    return emb.masked_scatter(mask, codes.reshape(-1, codes.shape[-1]).to(emb.dtype))


def code_lm_loss(model, batch: Batch, referent_weight: float = 0.0, parts: dict | None = None) -> torch.Tensor:
    """Next-token loss on the assistant turns, plus ``referent_weight`` x the referent-attention loss
    (``training/target/referents.py``) when the batch carries referent targets; ``parts`` gets each term's value."""
    lm = model.model.language_model
    x = code_embeds(model, batch.input_ids, batch.patch_codes)  # [B, L, H]
    refs = referent_weight > 0 and bool(batch.referents)
    with eager_attention(lm, refs):
        out = lm(inputs_embeds=x, attention_mask=batch.attention_mask, output_attentions=refs)
    hidden = out.last_hidden_state  # [B, L, H]
    tgt = batch.labels[:, 1:]  # [B, L-1]
    sel = tgt != -100
    loss = F.cross_entropy(model.lm_head(hidden[:, :-1][sel]).float(), tgt[sel])
    if parts is not None:
        parts["lm"] = float(loss.detach())
    if refs:
        ref = referent_attention_loss(out.attentions, batch.referents)
        if ref is not None:
            loss = loss + referent_weight * ref
            if parts is not None:
                parts["referent"] = float(ref.detach())
    return loss


def code_vision_loss(img: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Squared error per patch, summed over the width and averaged over patches.

    img # [N, T, H] projector outputs; codes # [N, T, H]
    """
    return (img.float() - codes.float()).pow(2).sum(-1).mean()


def code_cosine(img: torch.Tensor, codes: torch.Tensor) -> float:
    """Mean cosine between projector outputs and codes over the patches that show something  # img, codes [N, T, H]"""
    keep = codes.norm(dim=-1) > 0  # [N, T]
    if not keep.any():
        return 0.0
    return float(F.cosine_similarity(img[keep].float(), codes[keep].float(), dim=-1).mean())


def code_answers(model, processor, codes: WordCodes, samples, blank: bool = False, max_new_tokens: int = 8,
                 layers: int = 0) -> list[str]:
    """Greedy answers (or captions: a larger ``max_new_tokens``) with codes, or a blank image's codes (``blank``), in
    the image positions: what the LM reads from a perfect tower."""
    from specula.training.target.quality import answer_with_visual

    was_training = model.training
    model.eval()
    out = []
    with shallow(model.model.language_model, layers):
        for s in samples:
            c = codes.images(s.patch_words).flatten(0, 1)  # [n_img * T, H]
            out.append(answer_with_visual(model, processor, s, codes.blank(1, len(c)).flatten(0, 1) if blank else c,
                                          max_new_tokens))
    model.train(was_training)
    return out


def code_answer_hits(model, processor, codes: WordCodes, samples, blank: bool = False, max_new_tokens: int = 8,
                     layers: int = 0) -> list[bool]:
    """Greedy short answers from codes (``code_answers``); exact match per sample."""
    hits = []
    for s, pred in zip(samples, code_answers(model, processor, codes, samples, blank, max_new_tokens, layers)):
        if s.kind.startswith("reasoning") or "." in pred:
            pred = pred.split(".")[0]
        hits.append(normalize(pred) == normalize(s.answer or ""))
    return hits


def code_lm_lr(done: int, cfg) -> float:
    warm = max(1, cfg.warmup_samples // 4)
    if done < warm:
        return cfg.code_lm_lr * max(done, 1) / warm
    frac = min(1.0, (done - warm) / max(1, cfg.code_lm_samples - warm))
    return cfg.code_lm_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def code_lm_stage(model, encoder, codes: WordCodes, cfg, state: dict, save, sample_at, eval_samples, log=print) -> None:
    """Train the LM on word codes until ``state["code_lm_samples"]`` reaches ``cfg.code_lm_samples``; resumable.
    ``cfg.code_lm_stop`` ends it sooner on the same schedule, unfinished (no identity layers, no ``code_lm_done``).

    ``save(extra)`` checkpoints the model and ``state`` plus ``extra`` (name -> state dict: this stage's optimizer,
    saved as ``code_optimizer.pt``); on resume the caller puts that back in ``state["_code_opt_state"]``.
    ``sample_at(i, frac)`` draws training sample ``i``.
    """
    lm = model.model.language_model
    params = list(lm.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.code_lm_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    if state.get("_code_opt_state") is not None:
        opt.load_state_dict(state.pop("_code_opt_state"))
    done = state.setdefault("code_lm_samples", 0)
    bar = tqdm(total=cfg.code_lm_samples, initial=done, unit="sample", desc="code LM stage", mininterval=5.0)
    last_ckpt = last_eval = t_last = time.time()
    ema, ema_ref = None, None
    model.train()
    end = cfg.code_lm_stop or cfg.code_lm_samples  # a stop cuts the stage short without changing its schedule
    with shallow(lm, cfg.code_lm_layers):
        while state["code_lm_samples"] < end:
            start = state["code_lm_samples"]
            frac = start / cfg.code_lm_samples
            items = [encoder.encode(sample_at(CODE_STREAM + start + j, frac)) for j in range(cfg.pool)]
            for group in token_budget_batches(items, cfg.code_token_budget):
                batch = collate(group, encoder.tok.pad_token_id)
                for g in opt.param_groups:
                    g["lr"] = code_lm_lr(state["code_lm_samples"], cfg)
                parts: dict[str, float] = {}
                loss = code_lm_loss(model, batch, cfg.referent_attention, parts)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                state["code_lm_samples"] += batch.n_samples
                bar.update(batch.n_samples)
                lm_part = parts.get("lm", float(loss.detach()))
                ema = lm_part if ema is None else 0.98 * ema + 0.02 * lm_part
                if "referent" in parts:
                    r = parts["referent"]
                    ema_ref = r if ema_ref is None else 0.98 * ema_ref + 0.02 * r
            now = time.time()
            state["elapsed_s"] += now - t_last
            t_last = now
            bar.set_postfix({"lm": f"{ema:.3f}"} | ({"referent": f"{ema_ref:.3f}"} if ema_ref is not None else {}),
                            refresh=False)
            if now - last_eval > cfg.eval_every_s:
                _log_eval(model, encoder.processor, codes, cfg, state, eval_samples, ema, log, ema_ref)
                last_eval = t_last = time.time()
            if now - last_ckpt > cfg.ckpt_every_s:
                save({"code_optimizer": opt.state_dict()})
                last_ckpt = time.time()
    bar.close()
    _log_eval(model, encoder.processor, codes, cfg, state, eval_samples, ema, log, ema_ref)
    if state["code_lm_samples"] < cfg.code_lm_samples:  # stopped: unfinished, its optimizer kept for the next run
        save({"code_optimizer": opt.state_dict()})
        return
    if cfg.code_lm_layers and "code_lm_grown_from" not in state:
        n = make_identity(lm, cfg.code_lm_layers)
        state["code_lm_grown_from"] = cfg.code_lm_layers
        if n:
            log(f"code LM stage: layers {cfg.code_lm_layers}..{cfg.code_lm_layers + n - 1} start as identities")
    state["code_lm_done"] = True
    save({})


def _log_eval(model, processor, codes, cfg, state, samples, ema, log, ema_ref=None) -> None:
    hits = code_answer_hits(model, processor, codes, samples, layers=cfg.code_lm_layers)
    blank = code_answer_hits(model, processor, codes, samples, blank=True, layers=cfg.code_lm_layers)
    res = {"stage": "code_lm", "code_vqa_exact": round(sum(hits) / max(1, len(hits)), 4),
           "code_vqa_exact_blank": round(sum(blank) / max(1, len(blank)), 4),
           "samples": state["code_lm_samples"], "minutes": round(state["elapsed_s"] / 60, 1),
           "loss_lm": None if ema is None else round(ema, 4)}
    if ema_ref is not None:
        res["loss_referent"] = round(ema_ref, 4)
    state["history"].append(res)
    log(json.dumps(res))
