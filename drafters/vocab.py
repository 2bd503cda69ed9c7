"""A drafter LM's vocabulary against the target's: which ids it may draft, and why a tokenizer is refused.

The draft-model method (HF assisted generation, vLLM and SGLang's draft models) needs the drafter's token ids to
mean what the target's mean. Three sizes are in play for each model: its tokenizer's length, its embedding / LM
head rows (often padded past the tokenizer: Qwen2.5-0.5B has 151,936 rows for 151,665 tokens) and, for the target,
the width of its logits (LLaVA-1.5: 32,064 for a tokenizer of 32,002 over Llama's 32,000). The rule:

- the drafter's tokenizer must be a prefix of the target's: every id the drafter's tokenizer has is the same token
  in the target's (the target may add tokens after it, as LLaVA adds ``<image>`` and ``<pad>`` after Llama's), and
  a probe text encodes to the same ids;
- the drafter drafts only ids below ``shared`` = min(its tokenizer's length, its rows, the target's width): its q
  is 0 on every other id (padded with zeros up to the target's width, or cut to it and renormalised), and the
  drafts are drawn from exactly that q, so verification stays lossless;
- a target id the drafter lacks (>= ``shared``, e.g. LLaVA's ``<pad>``) is fed to the drafter as ``substitute``.

Where a tokenizer is missing on one side only sizes can be compared: with the drafter's tokenizer known, its
length must not exceed the target's width; with neither, the drafter's rows must equal the target's width (or the
target tokenizer's length).

    vocab = check_vocab("text_lm", rows=32000, target_width=32064, drafter_tok=llama_tok, target_tok=llava_tok)
    vocab.shared == 32000   # q [B, N, 32064] is 0 on ids 32000 ..
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE = "The quick brown fox, 12 cats and 3.5 dogs: what colour is the star? It's red!\nA shape (left) sits below."


@dataclass(frozen=True)
class VocabMap:
    width: int  # V: the target's logits width, the last dim of every q the drafter returns
    rows: int  # the drafter's LM head rows (its logits width)
    shared: int  # ids < shared are the drafter's and the target's both: the only ids it drafts, and feeds as is
    substitute: int  # the drafter id fed in place of a target id >= shared

    @property
    def identity(self) -> bool:
        """The drafter's logits are already the target's q width with nothing to mask."""
        return self.shared == self.rows == self.width


def as_tokenizer(tok):
    """A tokenizer resource: a tokenizer, a processor (its ``.tokenizer``), a local directory or None."""
    if tok is None:
        return None
    if isinstance(tok, (str, bytes)) or hasattr(tok, "__fspath__"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok, local_files_only=True)
    return tok if hasattr(tok, "convert_ids_to_tokens") else tok.tokenizer


def check_vocab(kind: str, rows: int, target_width: int | None, drafter_tok=None, target_tok=None,
                pad_token_id: int | None = None) -> VocabMap:
    """The ``VocabMap`` of a drafter with ``rows`` logits, or a ValueError saying what differs (module docstring).
    ``target_width`` None (no target known): the drafter's own rows."""
    width = rows if target_width is None else int(target_width)
    n_d = len(drafter_tok) if drafter_tok is not None else None
    n_t = len(target_tok) if target_tok is not None else None
    if n_d is not None and n_t is not None:
        _compare(kind, drafter_tok, target_tok, n_d, n_t)
    elif n_d is not None and target_width is not None and n_d > width:
        raise ValueError(f"{kind}: the drafter's tokenizer has {n_d} tokens, more than the target's vocabulary of "
                         f"{width}: it is not the target's tokenizer or a prefix of it")
    elif n_d is None and target_width is not None and rows not in (width, n_t):
        told = f" (its tokenizer {n_t})" if n_t is not None and n_t != width else ""
        raise ValueError(f"{kind}: drafter vocabulary {rows} != target's {width}{told}, and the drafter has no "
                         "tokenizer to compare: save its tokenizer beside the model to draft with a prefix of the "
                         "target's vocabulary")
    shared = min(rows, width, n_d if n_d is not None else rows)
    sub = next((t for t in (getattr(drafter_tok, "unk_token_id", None), pad_token_id)
                if isinstance(t, int) and 0 <= t < shared), 0)
    return VocabMap(width, rows, shared, sub)


def _compare(kind: str, drafter_tok, target_tok, n_d: int, n_t: int) -> None:
    """Refuse unless the drafter's tokenizer is the target's or a prefix of it, naming the first difference."""
    if n_d > n_t:
        extra = drafter_tok.convert_ids_to_tokens(list(range(n_t, min(n_d, n_t + 3))))
        raise ValueError(f"{kind}: the drafter's tokenizer has {n_d} tokens, the target's {n_t}: ids {n_t}.. "
                         f"({', '.join(map(repr, extra))}, ...) are not the target's; a drafter needs the target's "
                         "tokenizer or a prefix of it")
    ids = list(range(n_d))
    mine, theirs = drafter_tok.convert_ids_to_tokens(ids), target_tok.convert_ids_to_tokens(ids)
    diff = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    if diff:
        i = diff[0]
        more = f" ({len(diff)} ids differ)" if len(diff) > 1 else ""
        raise ValueError(f"{kind}: token {i} is {mine[i]!r} in the drafter's tokenizer but {theirs[i]!r} in the "
                         f"target's{more}: a drafter needs the target's tokenizer or a prefix of it")
    a = drafter_tok.encode(PROBE, add_special_tokens=False)
    b = target_tok.encode(PROBE, add_special_tokens=False)
    if a != b:
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise ValueError(f"{kind}: the tokenizers share their tokens but split text differently: {PROBE!r} encodes "
                         f"to {a[j:j + 4]} at token {j} with the drafter's and {b[j:j + 4]} with the target's")
