"""Loss weight on a scan listing's object verdicts: the "a"/"an" that opens a cell holding an object.

In a scan caption two cells in three say "no object", and a frozen-vision stage drifts towards saying it where an
object sits (zoo/TRAINING.md, "Referent attention in the frozen stage": object cells read right 0.885 -> 0.808 over
2.7k samples at a low rate, empty cells 0.866 -> 0.913). Weighting the next-token loss on the object cells' opening
word (a cell name's comma followed by "a"/"an") by ``weight`` balances the two verdicts; every other label keeps 1.

With the verdicts right, what is left is the object named inside a cell: fed the reference listing (``zoo eval
--scan-cells``, 60 held-out caption scenes), `runs/scan-j` names an object cell's colour right 0.73 of the time and
its shape 0.85, and three in four of the objects its captions put in a wrong cell belong to another cell, most often
a neighbour ("bottom left" given the object of "bottom"). ``phrase_weight`` weights the rest of an object cell's
phrase too (size, colour, shape, a second object after "and": every label after the opener up to the ";" or "." that
closes the cell), the words the lookup by place gives. At 3 it did not help over 4.1k samples (zoo/TRAINING.md,
"What a cell's phrase gets wrong").
"""

from __future__ import annotations

import torch


OBJECT_OPENERS = ("a", "an")  # "top left, a large purple cross"
PHRASE_STOPS = (";", ".")  # what closes a cell: "...; top, no object; ... bottom right, an orange star."
EMPTY_OPENERS = ("no",)  # "top, no object"


def opener_ids(tokenizer, words: tuple[str, ...] = OBJECT_OPENERS) -> tuple[int, tuple[int, ...]]:
    """(the comma after a cell's name, the ids of ``words`` opening the cell), as this tokenizer spells them."""
    parts = [tokenizer.tokenize(f"top, {w}") for w in words]
    if any(len(p) != 3 or p[1] != parts[0][1] for p in parts):
        raise ValueError(f"the tokenizer does not spell 'top, <word>' as three tokens for {words}")
    comma, *opens = tokenizer.convert_tokens_to_ids([parts[0][1]] + [p[2] for p in parts])
    return comma, tuple(opens)


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids of ``PHRASE_STOPS`` as this tokenizer spells them after a word ("star;" -> "▁star", ";")."""
    ids = []
    for p in PHRASE_STOPS:
        parts = tokenizer.tokenize(f"star{p}")
        if len(parts) != 2:
            raise ValueError(f"the tokenizer does not spell 'star{p}' as two tokens")
        ids.append(tokenizer.convert_tokens_to_ids(parts[1]))
    return tuple(ids)


def object_cell_weights(input_ids: torch.Tensor, labels: torch.Tensor, comma_id: int, opens: tuple[int, ...],
                        weight: float, stops: tuple[int, ...] = (), phrase_weight: float = 1.0) -> torch.Tensor:
    """Per-label loss weights: ``weight`` where the label is an object opener right after a comma,
    ``phrase_weight`` on the rest of that object cell's phrase (up to, not including, the next of ``stops``), 1
    elsewhere.

    input_ids, labels  # [B, L] int64 (labels -100 outside the answer)
    returns            # [B, L] fp32, aligned with ``labels``
    """
    w = torch.ones(labels.shape, dtype=torch.float32)  # [B, L]
    opening = cell_openings(input_ids, labels, comma_id, opens)  # [B, L-1]
    if phrase_weight != 1.0:
        if not stops:
            raise ValueError("phrase_weight needs the stop ids that close a cell")
        w[:, 1:][object_phrases(opening, labels[:, 1:], stops)] = phrase_weight
    w[:, 1:][opening] = weight
    return w


def object_phrases(opening: torch.Tensor, labels: torch.Tensor, stops: tuple[int, ...]) -> torch.Tensor:
    """Labels inside an object cell's phrase: from its opener through the last label before a stop.

    opening  # [B, M] bool, True where labels[:, j] opens an object cell
    labels   # [B, M] int64
    returns  # [B, M] bool
    """
    idx = torch.arange(labels.shape[-1]).expand_as(labels)  # [B, M]
    none = torch.full_like(idx, -1)
    last_open = torch.where(opening, idx, none).cummax(-1).values  # [B, M] latest opener at or before j
    last_stop = torch.where(torch.isin(labels, torch.tensor(stops)), idx, none).cummax(-1).values  # [B, M]
    return (last_open > last_stop) & (labels != -100)


def cell_openings(input_ids: torch.Tensor, labels: torch.Tensor, comma_id: int, opens: tuple[int, ...]) -> torch.Tensor:
    """Where a cell's verdict is predicted: the answer's commas whose next label is one of ``opens``.

    input_ids, labels  # [..., L] int64 (labels -100 outside the answer)
    returns            # [..., L-1] bool: True at position p when labels[p + 1] opens a cell after the comma at p
    """
    return (input_ids[..., :-1] == comma_id) & torch.isin(labels[..., 1:], torch.tensor(opens))
