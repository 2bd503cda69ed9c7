"""Chart readout: make the head that finds a chart's part also say what the part shows.

With the chart reading words (``--chart-words``, training/target/chart_words.py) a bar's visual tokens carry its value, read back
at 1.00 by ``python -m research probe-charts``, and ``--chart-referents`` trains head 0 of layer 1 to put its mass on the asked
bar (its loss falls to ~0.05, -log of the mass). The answers did not follow: after 9,200 joint samples the bar-value
answers were near-constant digits ("9" 35 times, "1" 22 of 81; zoo/TRAINING.md, "Chart reading words"), while
"tallest", a colour word, was read at 0.93. Image sets showed the same split, where ``--set-readout``
(training/target/set_readout.py) made the head that points at the right image also say its colour.

``--chart-readout W`` does that for charts. At every ``"chart"`` target of ``training/target/chart_referents.py`` whose hop is the
part lookup (not the number hop of a run without the words), the lookup head's own output is read out alone
(``set_readout.head_logits``: its slice of ``o_proj``, scaled to unit RMS, through the final norm's gain and the LM
head, neither of which gets gradient) and its cross-entropy against the answer is the loss, at the answers that are a
value's digit.

Only values: the head's output is a mix of its values, which depend on the patches it reads and not on the question.
The same bar is the lookup of "what is the value of the green bar?" (its digit), of "which bar is the tallest?" (its
colour) and, at the ``whole`` level, of "how many bars are there?" (every bar, the count word), so a readout of every
lookup answer asks the same output for three words. A first run read them all: its loss went 10.7 -> 3.0 in 5,700
samples (ln V is 7.6), the lookup's own loss rose 0.05 -> 0.45 (the head left the part), and the bar values stayed at
0.14 on 400 with "four" among their answers (zoo/TRAINING.md, "Chart readout"). The superlatives and counts were
read without a readout (zoo/TRAINING.md, "Chart reading words").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specula.training.target.referents import PATCH_LAYER, ReferentTarget
from specula.training.target.set_readout import picked_readout_loss

READ_LAYER = PATCH_LAYER  # the chart lookup's patch hop (chart_referents: head 0 of layer 1) is the head read out
VALUES = tuple(str(v) for v in range(1, 10))  # a bar's, point's or slice's value (world/charts.py draws 1..9)


def value_token_ids(word_id: Callable[[str], int]) -> torch.Tensor:
    """The single-token values, the answers the readout reads: # [K] int64."""
    return torch.tensor(sorted({word_id(v) for v in VALUES} - {-1}), dtype=torch.long)


def chart_readout_loss(lm, lm_head, got: dict, targets: Sequence[Sequence[ReferentTarget]],
                       labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """Mean cross-entropy of each ``"chart"`` lookup target's head read out alone against the answer token its
    position predicts, over the targets whose answer is in ``keep`` (``value_token_ids``); None when the batch has
    none.

    got: ``set_readout.head_inputs``' captures (layer ``READ_LAYER`` among them); labels # [B, L] (-100 outside the
    answers, the answer's first token at ``query + 1``); keep # [K] token ids.
    """
    keep = set(keep.tolist())
    rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (layer, head) -> [(b, query, token)]
    for b, row in enumerate(targets):
        for t in row:
            if t.group != "chart" or t.patch_layer != READ_LAYER or t.query + 1 >= labels.shape[1]:
                continue
            tok = int(labels[b, t.query + 1])
            if tok in keep and t.patch_layer in got:
                rows.setdefault((t.patch_layer, t.head), []).append((b, t.query, tok))
    return picked_readout_loss(lm, lm_head, got, rows)
