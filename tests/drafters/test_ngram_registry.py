"""The n-gram drafter and the drafter registry."""

import pytest
import torch

from specula.drafters import DraftContext, Drafter, Verdict, create, kinds
from specula.drafters.ngram import lookup


def test_lookup_prefers_longest_and_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], gamma=2, min_n=1, max_n=3) == [7, 1]
    assert lookup([4, 5, 6], gamma=2, min_n=2, max_n=3) == []
    assert lookup([8, 3, 8], gamma=4, min_n=1, max_n=2, banned=None) == [3, 8]


def test_lookup_never_proposes_banned_token():
    assert lookup([5, 1, 99, 2, 5], gamma=3, min_n=1, max_n=1, banned=99) == [1]


def test_ngram_drafter_follows_the_verdicts():
    d = create({"kind": "ngram", "max_n": 2})
    assert isinstance(d, Drafter) and d.spec.structure == "chain"
    d.begin([DraftContext("a", torch.tensor([1, 2, 3, 1, 2]), first_token=3),
             DraftContext("b", torch.tensor([7, 7]), first_token=8)])
    p = d.propose(["a", "b"], gamma=3)
    assert p.request_ids == ("a", "b") and p.q is None
    assert p.tokens[0, :p.counts[0]].tolist() == [1, 2, 3]
    assert p.counts[1] == 0  # "7 7 8": no earlier occurrence of "8" or "7 8" continues
    d.observe([Verdict("a", (0,), (1,), 5), Verdict("b", (), (), 7)])
    p2 = d.propose(["b"], gamma=2)
    assert p2.tokens[0, :p2.counts[0]].tolist() == [8, 7]  # "7 7 8 7": the latest earlier "7" was followed by "8 7"
    d.release(["a", "b"])
    with pytest.raises(KeyError):
        d.propose(["a"], 2)


def test_registry_errors_are_clear():
    assert "ngram" in kinds()
    with pytest.raises(ValueError, match="unknown drafter kind"):
        create({"kind": "nope"})
    with pytest.raises(ValueError, match="needs a 'kind'"):
        create({})
    with pytest.raises(ValueError, match="min_n"):
        create({"kind": "ngram", "min_n": 3, "max_n": 2})


def test_accepted_options_follow_options_passed_on_to_the_base_class():
    from specula.drafters import registry

    assert {"target", "device", "tokens_per_pass"} <= registry.accepted_options("flash")  # via EagleDrafter
    assert "target" in registry.accepted_options("eagle")
    assert "target" not in registry.accepted_options("ngram") and "image_token_id" in registry.accepted_options("ngram")
    assert registry.accepted_options("no-such-kind") == frozenset()
