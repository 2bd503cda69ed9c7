"""Loss weight on a scan listing's object verdicts: the "a"/"an" that opens a cell holding an object.

In a scan caption two cells in three say "no object", and a frozen-vision stage drifts towards saying it where an
object sits (zoo/TRAINING.md, "Referent attention in the frozen stage": object cells read right 0.885 -> 0.808 over
2.7k samples at a low rate, empty cells 0.866 -> 0.913). Weighting the next-token loss on the object cells' opening
word (a cell name's comma followed by "a"/"an") by ``weight`` balances the two verdicts; every other label keeps 1.

With the verdicts right, what is left is the object named inside a cell (``zoo eval --scan-cells``); weighting the
rest of an object cell's phrase as well did not help (zoo/TRAINING.md, "What a cell's phrase gets wrong, and
captions by colour").
"""

from __future__ import annotations

import torch


OBJECT_OPENERS = ("a", "an")  # "top left, a large purple cross"
EMPTY_OPENERS = ("no",)  # "top, no object"


def opener_ids(tokenizer, words: tuple[str, ...] = OBJECT_OPENERS) -> tuple[int, tuple[int, ...]]:
    """(the comma after a cell's name, the ids of ``words`` opening the cell), as this tokenizer spells them."""
    parts = [tokenizer.tokenize(f"top, {w}") for w in words]
    if any(len(p) != 3 or p[1] != parts[0][1] for p in parts):
        raise ValueError(f"the tokenizer does not spell 'top, <word>' as three tokens for {words}")
    comma, *opens = tokenizer.convert_tokens_to_ids([parts[0][1]] + [p[2] for p in parts])
    return comma, tuple(opens)


def object_cell_weights(input_ids: torch.Tensor, labels: torch.Tensor, comma_id: int, opens: tuple[int, ...],
                        weight: float) -> torch.Tensor:
    """Per-label loss weights: ``weight`` where the label is an object opener right after a comma, 1 elsewhere.

    input_ids, labels  # [B, L] int64 (labels -100 outside the answer)
    returns            # [B, L] fp32, aligned with ``labels``
    """
    w = torch.ones(labels.shape, dtype=torch.float32)  # [B, L]
    w[:, 1:][cell_openings(input_ids, labels, comma_id, opens)] = weight  # [B, L-1]
    return w


def cell_openings(input_ids: torch.Tensor, labels: torch.Tensor, comma_id: int, opens: tuple[int, ...]) -> torch.Tensor:
    """Where a cell's verdict is predicted: the answer's commas whose next label is one of ``opens``.

    input_ids, labels  # [..., L] int64 (labels -100 outside the answer)
    returns            # [..., L-1] bool: True at position p when labels[p + 1] opens a cell after the comma at p
    """
    return (input_ids[..., :-1] == comma_id) & torch.isin(labels[..., 1:], torch.tensor(opens))
