"""``sample_next`` (greedy fast path) gives the tokens ``sample(logits_to_probs(...))`` gives, row for row."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.core.sampling import SamplingParams, logits_to_probs, sample, sample_next

GREEDY = SamplingParams()
HOT = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
PLAIN = SamplingParams(temperature=1.3, min_p=0.05, seed=2)


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(n)]


@pytest.mark.parametrize("rows", [[GREEDY] * 3, [HOT, PLAIN, HOT], [GREEDY, HOT, GREEDY, PLAIN]],
                         ids=["all_greedy", "all_sampled", "mixed"])
def test_sample_next_equals_general_path(rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows), 300, generator=g) * 3
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: both paths take the first index
    for step in range(20):
        fast_gens, ref_gens = _gens(len(rows), step), _gens(len(rows), step)
        fast = sample_next(logits, rows, fast_gens)
        ref = sample(logits_to_probs(logits, rows), ref_gens)
        assert torch.equal(fast, ref)
        for b, p in enumerate(rows):  # sampled rows consumed exactly the same draws
            if not p.is_greedy:
                assert torch.equal(fast_gens[b].get_state(), ref_gens[b].get_state())
        logits = logits.roll(7, dims=-1)
    assert sample_next(logits, [GREEDY] * len(rows), _gens(len(rows))).tolist() == logits.argmax(-1).tolist()


def test_sample_next_rejects_bad_input():
    with pytest.raises(ValueError, match="float tensor"):
        sample_next(torch.zeros(2, 5, dtype=torch.long), [GREEDY] * 2, _gens(2))
    with pytest.raises(ValueError, match="float tensor"):
        sample_next(torch.zeros(5), [GREEDY], _gens(1))
    with pytest.raises(ValueError, match="2 rows"):
        sample_next(torch.zeros(2, 5), [GREEDY], _gens(2))
