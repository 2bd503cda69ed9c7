"""Seed the count hop's keys with what each image shows (``--set-count-key-fit N``).

The count hop (training/target/set_count.py) has to score a summary token by whether its image shows the asked shape: a
bilinear form between the query (the asked shape, fetched by the word hop) and the key (the shapes the summary head
read). Trained from both ends at once it sits at a saddle: while the keys carry no shape, the query's gradient
towards the shape is zero, and the other way round. The image-set lanes trained the hop's landing within ~1,000
samples and no match in 9,000 (0.095 on each matching summary against 0.098 on each other at 58,224).

Measured on a lane's checkpoint (56,640; zoo/TRAINING.md, "Image sets: the count hop's saddle, and a key fit past
it"): a ridge probe reads each summary token's shapes from
the count layer's input at 0.975 (held out), and the asked shape from the query's at 1.00, so the features are
there. Fitting only the head's W_Q / W_K to the count targets on those cached features (RoPE and the causal softmax
exact) still found no match in 400 steps, in any rank and even confined to the slowest rotary pairs: the saddle,
not the data. With the key side built from the probe and only the query learnt, the match formed within 50 steps
on held-out sets (0.27 on each matching summary against 0.12 on each other) and the first token's share began to
follow m.

``fit_count_keys`` does that building once, before the joint stage: it reads ``n`` training dialogues with
counting turns, ridge-fits the count layer's normed input at every summary token onto the image's shapes (+1 shown,
-1 not), and writes ``KEY_SCALE`` times the fit into the count head's ``k_proj`` rows of the ``len(SHAPES)``
slowest rotary pairs (the first of each pair; RoPE turns them by at most ~0.6 rad over a thousand tokens, so the
match holds across a set), zeroing the pairs' other rows. The head's ``q_proj`` rows of those pairs are zeroed, so
the new key dimensions change no attention score until the query learns to use them; the head loses only what those
six pairs did before. Nothing else in the model changes.

With ``query_steps`` (``--set-count-query-steps``) the query is then fitted too: Adam on the head's whole ``q_proj``
slice alone, against the count hop's targets on the same dialogues (``count_hop_loss``: the attention recomputed
from the cached layer input with the rotary tables and the causal softmax, equal to the model's own eager weights),
the keys held as written. On those cached features a query confined to the six pairs matched less well (0.13
against 0.09 on each matching / other summary) than the whole slice (0.20 against 0.06), which also sets how much
stays on the first token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specula.world.vocab import SHAPES
from specula.training.target.set_count import COUNT_HEAD, COUNT_LAYER

KEY_SCALE = 3.0  # the fitted key's size: a shown shape's key near +3, an absent one near -3
RIDGE = 1e-2


@dataclass(frozen=True)
class CountKeyFit:
    """What ``fit_count_keys`` did (recorded in a run's ``state.json``)."""

    dialogues: int  # dialogues read (each with at least one counting turn and its summary tokens)
    summaries: int  # summary tokens fitted on
    probe_accuracy: float  # the fit's sign against shown / not shown, fitted on half the dialogues, on the other half
    base_rate: float  # what always guessing each shape's commoner answer gives on that half
    dims: tuple[int, ...]  # the head dimensions whose key rows now hold the fit, one per shape in SHAPES order
    query_steps: int = 0  # Adam steps on the head's query against the count hop's targets, the keys as written
    query_loss_before: float | None = None  # the count hop's loss on the fitting dialogues before those steps
    query_loss_after: float | None = None  # ... and after


def slow_pairs(head_dim: int, n: int) -> tuple[int, ...]:
    """The first dimension of each of the ``n`` slowest rotary pairs of a head (HF rotate_half pairs d and
    d + head_dim / 2, and its frequency falls with d)."""
    half = head_dim // 2
    if not 0 < n <= half:
        raise ValueError(f"need 1..{half} rotary pairs, asked for {n}")
    return tuple(range(half - n, half))


@dataclass(frozen=True)
class CountRow:
    """One dialogue's count layer input up to its last counting answer, for fitting the count head's query."""

    h: torch.Tensor  # [L, D] the count layer's normed input
    cos: torch.Tensor  # [L, head_dim] the rotary tables at those positions
    sin: torch.Tensor  # [L, head_dim]
    turns: tuple[tuple[int, tuple[int, ...]], ...]  # (query position, the count hop's target positions) per turn


def collect_summaries(model, encoder, n: int, seed: int, progress: bool = True,
                      keep_rows: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The count layer's normed input at every summary token of ``n`` counting dialogues, what each image shows,
    and which dialogue each came from: X # [S, D], Y # [S, len(SHAPES)] in {0, 1}, rows # [S]. With ``keep_rows``
    each dialogue's ``CountRow`` is appended to it as well."""
    from specula.world.image_sets import make_multi_dialogue

    if not encoder.set_count:
        raise ValueError("fit_count_keys needs an Encoder with set_count=True")
    lm = model.model.language_model
    layer = lm.layers[COUNT_LAYER]
    shape_of = {encoder.word_id(s): i for i, s in enumerate(SHAPES)}
    device = next(model.parameters()).device
    xs, ys, rows = [], [], []
    got, i = 0, 0
    bar = tqdm(total=n, unit="dialogue", desc="count key fit", mininterval=5.0, disable=not progress)
    with torch.no_grad():
        while got < n:
            if i > 20 * n:
                raise RuntimeError(f"only {got} of {n} dialogues had summary tokens: are the sets numbered "
                                   "(--number-images)?")
            s = make_multi_dialogue(random.Random(f"count-key-fit/{seed}/{i}"), "multi_image", "dialogue")
            i += 1
            e = encoder.encode(s)
            summ = [t for t in e.referents if t.group == "set_count" and t.says]
            if not summ:
                continue
            out = model(input_ids=e.input_ids[None].to(device), pixel_values=e.pixel_values.to(device),
                        attention_mask=torch.ones_like(e.input_ids)[None].to(device), output_hidden_states=True)
            h = layer.input_layernorm(out.hidden_states[COUNT_LAYER][0])  # [L, D]
            if keep_rows is not None:
                turns = tuple((t.query, t.patches) for t in e.referents
                              if t.group == "set_count" and t.spread and t.patches)
                if turns:
                    end = max(q for q, _ in turns) + 1
                    pos = torch.arange(end, device=device)[None]
                    cos, sin = lm.rotary_emb(h[None, :end], pos)
                    keep_rows.append(CountRow(h[:end].float().cpu(), cos[0].float().cpu(), sin[0].float().cpu(),
                                              turns))
            for t in summ:
                y = torch.zeros(len(SHAPES))
                y[[shape_of[w] for w in t.says if w in shape_of]] = 1
                xs.append(h[t.query].float().cpu())
                ys.append(y)
                rows.append(got)
            got += 1
            bar.update(1)
    bar.close()
    return torch.stack(xs), torch.stack(ys), torch.tensor(rows)


def ridge_fit(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """The no-bias ridge map from x # [S, D] onto y # [S, K] in {0, 1} coded as -1 / +1: A # [K, D]."""
    t = y * 2 - 1
    return torch.linalg.solve(x.T @ x + ridge * torch.eye(x.shape[1]), x.T @ t).T


def write_keys(model, a: torch.Tensor, scale: float = KEY_SCALE) -> tuple[int, ...]:
    """Put ``scale * a`` (# [len(SHAPES), D]) into the count head's key rows of the slowest rotary pairs, zero the
    pairs' other key rows and the head's query rows of both; returns the dimensions written."""
    attn = model.model.language_model.layers[COUNT_LAYER].self_attn
    hd = model.config.text_config.head_dim or model.config.text_config.hidden_size // \
        model.config.text_config.num_attention_heads
    dims = slow_pairs(hd, a.shape[0])
    base = COUNT_HEAD * hd
    with torch.no_grad():
        wk, wq = attn.k_proj.weight, attn.q_proj.weight  # [heads * hd, D]
        for j, d in enumerate(dims):
            wk[base + d] = (scale * a[j]).to(wk)
            for w in (wq[base + d], wq[base + d + hd // 2], wk[base + d + hd // 2]):
                w.zero_()
            for proj in (attn.k_proj, attn.q_proj):
                if proj.bias is not None:
                    proj.bias[base + d] = 0
                    proj.bias[base + d + hd // 2] = 0
    return dims


def count_hop_loss(wq: torch.Tensor, wk: torch.Tensor, rows, scale: float) -> torch.Tensor:
    """The count hop's spread loss (training/target/referents.py, ``spread``) of a head with query / key maps wq, wk
    (# [head_dim, D]) over ``rows`` (CountRow), computed exactly: rotary positions and the causal softmax."""
    from transformers.models.llama.modeling_llama import rotate_half

    terms = []
    for r in rows:
        k = r.h @ wk.T  # [L, hd]
        k = k * r.cos + rotate_half(k) * r.sin
        for q_pos, targets in r.turns:
            q = r.h[q_pos] @ wq.T  # [hd]
            q = q * r.cos[q_pos] + rotate_half(q) * r.sin[q_pos]
            logp = (k[:q_pos + 1] @ q * scale).log_softmax(0)  # [q_pos + 1]
            terms.append(-logp[list(targets)].mean())
    return torch.stack(terms).mean()


def fit_count_query(model, rows, steps: int, lr: float = 3e-3, batch: int = 16, seed: int = 0) -> tuple[float, float]:
    """Adam on the count head's whole ``q_proj`` slice alone, against ``count_hop_loss`` on ``rows`` (the keys as
    written); the result is written into the model. Returns the loss before and after."""
    attn = model.model.language_model.layers[COUNT_LAYER].self_attn
    cfg = model.config.text_config
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    sl = slice(COUNT_HEAD * hd, (COUNT_HEAD + 1) * hd)
    wk = attn.k_proj.weight[sl].detach().float().cpu()
    wq = attn.q_proj.weight[sl].detach().float().cpu().clone().requires_grad_()
    scale = getattr(attn, "scaling", hd ** -0.5)
    if attn.q_proj.bias is not None or attn.k_proj.bias is not None:
        raise ValueError("the count query fit expects bias-free q / k projections (Llama)")
    with torch.no_grad():
        before = float(count_hop_loss(wq, wk, rows, scale))
    opt = torch.optim.Adam([wq], lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        loss = count_hop_loss(wq, wk, rng.sample(rows, min(batch, len(rows))), scale)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(count_hop_loss(wq, wk, rows, scale))
        attn.q_proj.weight[sl] = wq.detach().to(attn.q_proj.weight)
    return before, after


def fit_count_keys(model, encoder, n: int, seed: int, log=print, progress: bool = True,
                   query_steps: int = 0) -> CountKeyFit:
    """Read ``n`` counting dialogues, fit the summary tokens' shapes, write the count head's keys (see above)."""
    if n < 2:
        raise ValueError(f"the count key fit needs at least 2 dialogues, got {n}")
    cfg = model.config.text_config
    if COUNT_LAYER >= cfg.num_hidden_layers or COUNT_HEAD >= cfg.num_attention_heads:
        raise ValueError(f"the count hop (layer {COUNT_LAYER}, head {COUNT_HEAD}) is not in this LM")
    if (cfg.num_key_value_heads or cfg.num_attention_heads) != cfg.num_attention_heads:
        raise ValueError("the count key fit writes one head's keys: it needs as many key-value heads as query heads "
                         f"(this LM shares {cfg.num_key_value_heads} among {cfg.num_attention_heads})")
    was_training = model.training
    model.eval()
    kept: list = []
    x, y, rows = collect_summaries(model, encoder, n, seed, progress=progress, keep_rows=kept if query_steps else None)
    model.train(was_training)
    fit_half, test_half = rows % 2 == 0, rows % 2 == 1
    a = ridge_fit(x[fit_half], y[fit_half])
    acc = float(((x[test_half] @ a.T > 0).float() == y[test_half]).float().mean())
    common = (y[fit_half].mean(0) > 0.5).float()  # each shape's commoner answer on the fitting half
    base = float((y[test_half] == common).float().mean())
    dims = write_keys(model, ridge_fit(x, y))
    q_loss = (None, None)
    if query_steps:
        q_loss = fit_count_query(model, kept, query_steps, seed=seed)
        log(f"count query fit: {query_steps} steps, count hop loss {q_loss[0]:.3f} -> {q_loss[1]:.3f} on "
            f"{len(kept)} dialogues")
    fit = CountKeyFit(n, len(x), round(acc, 4), round(base, 4), dims, query_steps,
                      *(round(v, 4) if v is not None else None for v in q_loss))
    log(f"count key fit: {n} dialogues, {len(x)} summary tokens; the fit reads an image's shapes {acc:.3f} on the "
        f"held-out half (always the commoner answer: {base:.3f}); key rows {dims[0]}..{dims[-1]} of head "
        f"{COUNT_HEAD}, layer {COUNT_LAYER}")
    return fit
