"""Speculative sampling through ``SpecEngine`` emits exactly the target's law, for every drafter kind: the first
k = 3 tokens of n requests against the exact joint law (``distribution_check``), and each known fault
(``distribution_faults``) fails the same check (docs/design.md, "End-to-end distribution check").

Target: drafter_kit's lively tiny LLaVA, T = 1 (the ensemble: T = 0.5 on an image prompt), top_k = 4 (64 cells, none
above 0.09). Every correct run must also accept and reject often (at least n / 10 of each), so none passes on
rejections alone, and keep p > 1e-4 (false alarm 1e-4 per test). Each fault must give p < 1e-6; its n comes from
the divergence D = sum (pi' - pi)^2 / pi it induced at these seeds: the statistic is then about noncentral
chi-square(df, n D), df 43-63, whose 1e-6 critical values are 102-131 (figures in each fault's docstring).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))  # drafter_kit, test_ensemble's builders

import distribution_faults as faults  # noqa: E402
from distribution_check import chi2_test, exact_law, sample_first_tokens  # noqa: E402
from drafter_kit import copy_head, lively_target, world_requests  # noqa: E402

from specula.drafters import create  # noqa: E402
from specula.runtime.core.sampling import SamplingParams, logits_to_probs  # noqa: E402
from specula.targets import load_target  # noqa: E402
from specula.targets.processor import load_processor  # noqa: E402
from specula.targets.types import PrefillRequest  # noqa: E402
from specula.zoo.store import TOKENIZER_DIR  # noqa: E402

pytestmark = pytest.mark.statistical
K = 3
PARAMS = SamplingParams(temperature=1.0, top_k=4)
N = 4096  # requests per run; N2 for the one fault that needs it
N2 = 8192
ALPHA, FAULT_P = 1e-4, 1e-6
ENSEMBLE_T = 0.5  # top-4 mass 0.79 of the untruncated target: a member's q can exceed p on the support


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    model = lively_target(processor)
    base = world_requests(processor, 1, SamplingParams(), suites=["text"])[0]
    return {"processor": processor, "model": model, "base": base, "law": exact_law(model, base, PARAMS, K)}


def random_drafter(kit, structure: str = "chain", power: float = 4.0, position: int = 1):
    """The ``random`` drafter with a fixed peaked q over the tokens the target allows at the second position
    (q ~ mean_x1 p(x_2 | x_1)^power, so 0 < p < q happens, which is where the faults act), trees 2 x 2;
    ``position`` 2: the third position's (for a drafter whose first draft decides token 3)."""
    vocab = kit["model"].config.text_config.vocab_size
    d = create({"kind": "random", "vocab_size": vocab, "structure": structure, "branching": 2, "depth": 2})
    q = torch.stack(list(kit["law"].steps[position].values())).mean(0) ** power  # [V]
    d.q = q / q.sum()  # the law it draws from and reports: still its true q
    return d


def run(kit, drafter, n: int, *, law=None, base=None, seed0: int = 1_000_000, **opts):
    """n requests through ``drafter``; returns the chi-square outcome and the run (tokens, accepted, rejected)."""
    r = sample_first_tokens(kit["model"], drafter, base or kit["base"], kit.get("params", PARAMS), n, K, seed0=seed0,
                            **opts)
    return chi2_test(r.tokens, law or kit["law"]), r


def assert_lossless(kit, drafter, n: int, **opts):
    result, r = run(kit, drafter, n, **opts)
    print(f"p={result.p_value:.3g} stat={result.stat:.1f} df={result.df} accepted={r.accepted} rejected={r.rejected}")
    assert r.accepted >= n // 10 and r.rejected >= n // 10, (r.accepted, r.rejected)
    assert result.p_value > ALPHA, result


def assert_detected(kit, drafter, n: int, **opts):
    result, r = run(kit, drafter, n, **opts)
    print(f"p={result.p_value:.3g} stat={result.stat:.1f} df={result.df} accepted={r.accepted} rejected={r.rejected}")
    assert result.p_value < FAULT_P, result


# ------------------------------------------------------------------------------------------- correct samplers


def test_plain_sampling_follows_the_law(kit):
    """The check itself: gamma 0 through the same engine (the reference the speculative runs must equal)."""
    result, _ = run(kit, None, N)
    assert result.p_value > ALPHA, result


def test_random_chain(kit):
    """gamma 2 (max_tokens 4): tokens 2 and 3 both decided by one chain block."""
    assert_lossless(kit, random_drafter(kit), N, gamma=2, max_tokens=4)


def test_random_chain_bonus(kit):
    """gamma 1 (max_tokens 3): token 3 is the bonus token whenever token 2's draft is accepted."""
    assert_lossless(kit, random_drafter(kit), N, gamma=1, max_tokens=3)


class AfterRejections:
    """A draft-length policy that reads the sampler's outcomes: 2 drafts after a step in which most rows rejected,
    1 otherwise, and a plain step every third step: the length of a block depends on the randomness of the blocks
    before it, the case an adaptive length must still keep lossless."""

    def __init__(self) -> None:
        self.steps, self.rejected_most, self.seen = 0, False, set()

    def choose(self, ids, rows=None) -> int:
        k = 0 if self.steps % 3 == 2 else (2 if self.rejected_most else 1)
        self.seen.add(k)
        return k

    def record_step(self, ids, k, draft_s, verify_s, drafted, accepted, **_) -> None:
        self.steps += 1
        if k > 0:
            self.rejected_most = sum(a < n for n, a in zip(drafted, accepted)) > len(ids) / 2

    def release(self, ids) -> None:
        pass


def test_random_chain_with_a_draft_length_chosen_from_past_outcomes(kit):
    policy = AfterRejections()
    assert_lossless(kit, random_drafter(kit), N, gamma=2, max_tokens=4, policy=policy, chunk=64)
    assert policy.seen == {0, 1, 2}


def test_random_chain_begun_after_the_second_token(kit):
    """The drafter begins lazily (begin_after 2): tokens 1 and 2 are plain, the drafter then replays that step and
    its first draft decides token 3 (max_tokens 4: one draft)."""
    assert_lossless(kit, random_drafter(kit, position=2), N, gamma=2, max_tokens=4, begin_after=2)


def test_random_tree(kit):
    """Two root siblings drawn without replacement, two children of the first (max_tokens 6: 4 nodes)."""
    assert_lossless(kit, random_drafter(kit, "tree", power=16.0), N, gamma=2, max_tokens=6)


@torch.no_grad()
def ngram_prompt(kit):
    """base + [a, b] + base, a = the likeliest first token, b the token whose p(b | prompt + a) is largest: after
    x_1 = a the ``ngram`` drafter proposes b (q one-hot), and the target allows it."""
    base, model = kit["base"], kit["model"]
    a = int(kit["law"].steps[0][()].argmax())
    vocab = model.config.text_config.vocab_size
    cands = [b for b in range(vocab) if b != model.config.image_token_id]
    ids = {b: torch.cat([base.input_ids, torch.tensor([a, b]), base.input_ids, torch.tensor([a])]) for b in cands}
    target = load_target(model)
    p = []
    for i in range(0, len(cands), 256):
        reqs = [PrefillRequest(f"b{b}", ids[b]) for b in cands[i:i + 256]]
        p.append(logits_to_probs(target.prefill(reqs).logits, PARAMS))  # [<=256, V]
        target.release([r.request_id for r in reqs])
    p = torch.cat(p)  # [C, V] row i: p(. | prompt_{cands[i]} + a)
    b = cands[int(p[torch.arange(len(cands)), torch.tensor(cands)].argmax())]
    return dataclasses.replace(base, input_ids=ids[b][:-1])


def test_ngram_chain(kit):
    """q = None (one-hot): a draft is accepted with probability p(x)."""
    base = ngram_prompt(kit)
    law = exact_law(kit["model"], base, PARAMS, K)
    assert_lossless(kit, create({"kind": "ngram"}), N, law=law, base=base, gamma=2, max_tokens=4)


def eagle(kit, structure: str = "chain"):
    """EAGLE with drafter_kit's copy head (the target's layer 0 over e(x_{i+1})): context-dependent q near p."""
    opts = {"structure": "tree", "top_k": 2, "depth": 2, "total_tokens": 4} if structure == "tree" else {}
    return create({"kind": "eagle", "head": copy_head(kit["model"]), **opts}, target=load_target(kit["model"]))


def test_eagle_chain(kit):
    assert_lossless(kit, eagle(kit), N, gamma=2, max_tokens=4)


def test_eagle_tree(kit):
    """EAGLE-2's sampled tree: sibling groups of 2 drawn without replacement from the head's q."""
    assert_lossless(kit, eagle(kit, "tree"), N, gamma=2, max_tokens=6)


@pytest.fixture(scope="module")
def image_kit(kit):
    """The same target on a vqa prompt with its image, for the ensemble (its multimodal member reads the image)."""
    base = world_requests(kit["processor"], 1, SamplingParams(), suites=["vqa"])[0]
    params = dataclasses.replace(PARAMS, temperature=ENSEMBLE_T)
    return {**kit, "base": base, "params": params, "law": exact_law(kit["model"], base, params, K)}


def ensemble(kit, structure: str = "chain"):
    """A multimodal member that is the target itself (no top-k cut) and a text-only member, weights 1 : 1."""
    from test_ensemble import massv_from_target

    model = massv_from_target(kit["model"], kit["processor"])
    return create({"kind": "ensemble", "model": model, "members": ["multimodal", "text"], "weights": [1, 3], "adapt": 0,
                   "join": "at_once", "structure": structure, "branching": [2, 1], "seed": 3},
                  target=load_target(kit["model"]))


@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_ensemble_mixture(image_kit, structure):
    """Drafts drawn from, and verified against, the mixture q."""
    assert_lossless(image_kit, ensemble(image_kit, structure), N, gamma=2, max_tokens=4 if structure == "chain" else 6)


# ------------------------------------------------------------------------------------------- faults


def test_fault_accept_every_draft_p_allows(kit, monkeypatch):
    """Measured D = 0.11: n D ~ 460 at n = 4096, the statistic ~ 520 against 125 for p = 1e-6."""
    faults.accept_every_draft_p_allows(monkeypatch)
    assert_detected(kit, random_drafter(kit), N, gamma=2, max_tokens=4)


def test_fault_q_squared(kit, monkeypatch):
    """Measured D = 0.039: n = 8192 gives n D ~ 320, the statistic ~ 380 (sd ~ 38) against 125 for p = 1e-6."""
    d = random_drafter(kit)
    faults.q_squared(monkeypatch, d)
    assert_detected(kit, d, N2, gamma=2, max_tokens=4)


def test_fault_bonus_from_q(kit, monkeypatch):
    """q has mass off p(x_3 | x_1, x_2)'s support: about a third of the bonus tokens fall outside it (p-value 0)."""
    faults.bonus_from_q(monkeypatch)
    assert_detected(kit, random_drafter(kit), N, gamma=1, max_tokens=3)


def test_fault_siblings_verified_as_independent(kit):
    """The drafter draws siblings without replacement; the engine verifies them as i.i.d. q ~ mean p^16 (peaked, so
    the second sibling's law given the first differs much from q): measured D = 0.11, n D ~ 450 at n = 4096."""
    assert_detected(kit, random_drafter(kit, "tree", power=16.0), N, gamma=2, max_tokens=6, siblings="independent")


@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_fault_one_members_q_instead_of_the_mixture(image_kit, monkeypatch, structure):
    """The first member (the target itself, untruncated) reported as q while drafts come from the 1 : 3 mixture with
    the text member. Measured D = 0.058 (chain) and 0.061 (tree): n D ~ 240 at n = 4096, the statistic ~ 280
    (sd ~ 32) against ~ 105 for p = 1e-6 (df 43)."""
    faults.one_member_q(monkeypatch)
    assert_detected(image_kit, ensemble(image_kit, structure), N, gamma=2,
                    max_tokens=4 if structure == "chain" else 6)
