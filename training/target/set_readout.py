"""Set readout: make the head that finds the named image also say what it sees there.

Numbered prompts solved addressing in attention (``--set-marks``: head 0 of layer 4 puts 0.78 of its mass on the
named image's objects at a "which" answer; zoo/TRAINING.md, "Image sets: numbered images, and where the answer is
read") and the answers did not follow: the LM reads an object's colour
with another head (head 0 of layer 1, the scene lookups' reader), which at a set's answer looks elsewhere. The
answer loss alone had 4,600 samples to route the colour through the head that points at the right patches and
did not.

``--set-readout W`` supervises that route directly. At every ``"set"`` target of ``training/target/set_referents.py`` whose
next token is a colour or a shape word (a "which" answer, the attribute words of a scan caption's line), the patch
hop head's own output ``c`` (its slice of ``o_proj``'s input, through that slice of ``o_proj``) is read the way the
LM's final norm and head would read it if it were the whole residual, ``lm_head(g * c / rms(c))`` with ``g`` the
final norm's gain, and its cross-entropy against the next token is the loss. Only the direction of ``c`` counts, so the
head learns *what* to write without first having to outgrow the residual (a first version divided by the final
residual's rms instead, the head's true share of the logits: after 450 samples its loss still sat at ln V, uniform).
How loud the head speaks is left to the answer loss. The LM head and norm get no gradient from the term; the head's
attention, value and output weights (and the layers below) do.

``--set-count-readout W`` reads the count circuit's summary hops the same way (``summary_readout_loss``): at each
image's summary token (training/target/set_count.py) the summary head, read out alone, should say the shapes that image shows.
``--set-count-number-readout W`` reads its count hop (``count_readout_loss``): at a counting answer the count head,
read out alone, should say the number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from specula.world.vocab import COLOUR_NAMES, SHAPES
from specula.training.target.referents import ReferentTarget


def readout_token_ids(word_id: Callable[[str], int]) -> torch.Tensor:
    """The single-token colour and shape words, the tokens a set's patches can say: # [K] int64."""
    return torch.tensor(sorted({word_id(w) for w in (*COLOUR_NAMES, *SHAPES)} - {-1}), dtype=torch.long)


@contextlib.contextmanager
def head_inputs(lm, layers: Iterable[int]):
    """Inside the block, each listed decoder layer's ``o_proj`` input (the heads' outputs side by side,
    # [B, L, heads * head_dim]) lands in ``got[layer]``."""
    got: dict = {}
    hooks = [lm.layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args, i=i: got.__setitem__(i, args[0])) for i in sorted(set(layers))]
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


def set_readout_loss(lm, lm_head, got: dict, targets: Sequence[Sequence[ReferentTarget]], labels: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor | None:
    """Mean cross-entropy of each ``"set"`` target's patch-hop head read out alone against the token it predicts,
    over the targets whose next token is in ``keep``; None when the batch has none.

    got: ``head_inputs``' captures; labels # [B, L] (-100 outside the answers); keep # [K] token ids.
    """
    keep = set(keep.tolist())
    rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (layer, head) -> [(b, query, token)]
    for b, row in enumerate(targets):
        for t in row:
            if t.group != "set" or t.query + 1 >= labels.shape[1]:
                continue
            tok = int(labels[b, t.query + 1])
            if tok in keep and t.patch_layer in got:
                rows.setdefault((t.patch_layer, t.head), []).append((b, t.query, tok))
    return picked_readout_loss(lm, lm_head, got, rows)


def picked_readout_loss(lm, lm_head, got: dict,
                        rows: dict[tuple[int, int], list[tuple[int, int, int]]]) -> torch.Tensor | None:
    """Mean cross-entropy of heads read out alone (``head_logits``) against the tokens picked for them;
    rows: (layer, head) -> [(batch row, query position, token id)]; None when there are none."""
    if not rows:
        return None
    losses = []
    for (layer, head), picks in rows.items():
        logits = head_logits(lm, lm_head, got, layer, head, [p[0] for p in picks], [p[1] for p in picks])  # [N, V]
        tok = torch.tensor([p[2] for p in picks], device=logits.device)  # [N]
        losses.append(F.cross_entropy(logits, tok, reduction="none"))
    return torch.cat(losses).mean()


def head_logits(lm, lm_head, got: dict, layer: int, head: int, rows: Sequence[int],
                queries: Sequence[int]) -> torch.Tensor:
    """One head's output at (row, query) pairs read out alone: its slice of ``o_proj``, scaled to unit RMS, through
    the final norm's gain and the LM head (both without gradient). # [N, V] fp32"""
    n_heads = lm.config.num_attention_heads
    head_dim = getattr(lm.config, "head_dim", None) or lm.config.hidden_size // n_heads
    dev = got[layer].device
    sl = slice(head * head_dim, (head + 1) * head_dim)
    x = got[layer][torch.tensor(list(rows), device=dev), torch.tensor(list(queries), device=dev), sl]  # [N, head_dim]
    contrib = (x @ lm.layers[layer].self_attn.o_proj.weight[:, sl].T).float()  # [N, H]
    inv_rms = torch.rsqrt(contrib.pow(2).mean(-1, keepdim=True) + lm.norm.variance_epsilon)  # [N, 1]
    return (contrib * inv_rms * lm.norm.weight.detach().float()) @ lm_head.weight.detach().float().T  # [N, V]


def summary_readout_loss(lm, lm_head, got: dict, targets: Sequence[Sequence[ReferentTarget]]) -> torch.Tensor | None:
    """``--set-count-readout``: each ``"set_count"`` summary target's head read out alone (``head_logits``) against
    the shape words its image shows (``ReferentTarget.says``; the cross-entropy with an even share on each, so an
    image of a circle and a star is read as both); None when the batch has none."""
    return _says_loss(lm, lm_head, got, targets, count_hops=False)


def count_readout_loss(lm, lm_head, got: dict, targets: Sequence[Sequence[ReferentTarget]]) -> torch.Tensor | None:
    """``--set-count-number-readout``: each count hop (the ``spread`` ``"set_count"`` target at a counting answer)
    read out alone against the number word it answers (its ``says``): the head's mix of the first token and the
    matching summaries, 1 / (m + 1) of it on the first, made to say m itself; None when the batch has none."""
    return _says_loss(lm, lm_head, got, targets, count_hops=True)


def _says_loss(lm, lm_head, got: dict, targets: Sequence[Sequence[ReferentTarget]],
               count_hops: bool) -> torch.Tensor | None:
    rows: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...]]]] = {}
    for b, row in enumerate(targets):
        for t in row:
            if t.group == "set_count" and t.says and t.spread == count_hops and t.patch_layer in got:
                rows.setdefault((t.patch_layer, t.head), []).append((b, t.query, t.says))
    if not rows:
        return None
    losses = []
    for (layer, head), picks in rows.items():
        logp = head_logits(lm, lm_head, got, layer, head, [p[0] for p in picks], [p[1] for p in picks]).log_softmax(-1)
        for i, (_, _, says) in enumerate(picks):
            losses.append(-logp[i, list(says)].mean())
    return torch.stack(losses).mean()
