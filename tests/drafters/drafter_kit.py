"""The harness the drafter tests share: lively tiny LLaVA targets with the world's tokenizer, heads built from them,
world prompts as engine requests, the plain-decoding reference and the greedy-equality driver, the recompute
checkers' plumbing, and the chi-square check of sampled output.

A uniquely named module, so test files import it directly (``from conftest import`` resolves to whichever
conftest.py pytest loaded last, which depends on collection order)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specula.drafters import create
from specula.drafters.eagle_head import EagleConfig, EagleHead
from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.runtime.engine.prompts import encode_prompt
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.world import generate
from specula.targets.embedded_arch import TargetArch, build_model

SUITES = ["vqa", "caption", "text", "multi_image", "chart", "reasoning"]
TREE = {"top_k": 3, "depth": 4, "total_tokens": 10}


# ---------------------------------------------------------------------------------------------- targets and heads


@contextmanager
def layer_inputs(head):
    """Record the decoder layer's input x [B, T, H] at every ``head.decode`` call (drafting runs the layer through
    ``drafters/lean_llama.py``, not the module's ``__call__``, so a forward hook on the layer would miss it)."""
    seen: list[torch.Tensor] = []
    decode = head.decode

    def recording(x, *args, **kwargs):
        seen.append(x.detach().clone())
        return decode(x, *args, **kwargs)

    head.decode = recording
    try:
        yield seen
    finally:
        del head.decode


def lively_target(processor, bigram: bool = False, generator: torch.Generator | None = None):
    """The tiny LLaVA (seed 1) with larger weights than the init, so greedy answers vary instead of repeating one
    token. ``bigram``: h_j depends on x_j only (layer 0 without attention, layer 1 the identity). The weights are
    drawn from ``generator`` (default: a fresh one seeded 0; pass one to keep drawing from it afterwards)."""
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    g = torch.Generator().manual_seed(0) if generator is None else generator
    lm = model.model.language_model
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
        if bigram:
            lm.layers[0].self_attn.o_proj.weight.zero_()
            lm.layers[1].self_attn.o_proj.weight.zero_()
            lm.layers[1].mlp.down_proj.weight.zero_()
    return model


def copy_head(model, noise: float = 0.0, h_mix: float = 0.0) -> EagleHead:
    """fc passes e(x_{i+1}) through (plus h_mix * random on h_i); the layer is the target's layer 0 (plus noise)."""
    head = EagleHead(EagleConfig.from_target(model))
    g = torch.Generator().manual_seed(0)
    h = head.config.hidden_size
    with torch.no_grad():
        head.layer.load_state_dict(model.model.language_model.layers[0].state_dict())
        head.fc.bias.zero_()
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.randn(h, h, generator=g) * h_mix], dim=1))
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return head.eval()


def random_head(model, std: float = 0.1) -> EagleHead:
    """A seeded head with weights large enough for sharp, context-dependent q (logits of order 10)."""
    head = EagleHead(EagleConfig.from_target(model))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, std, generator=g)
    return head.eval()


def as_msd(head: EagleHead):
    """An MSD head (decoupled) with ``head``'s weights: the same drafting and cache code, MSD's inputs."""
    from dataclasses import asdict

    from specula.drafters.msd_head import MsdConfig, MsdHead

    msd = MsdHead(MsdConfig(**{**asdict(head.config), "decoupled": True}))
    msd.load_state_dict(head.state_dict())
    return msd.eval()


@torch.no_grad()
def ref_head_outputs(head, hidden: torch.Tensor, nxt: list[int], path: list[int]) -> list[torch.Tensor]:
    """An eagle-style head's outputs after the committed pairs (hidden [m, H], nxt [m]) and after each node of
    ``path``, by full causal forwards from scratch: node j of the path was drawn from out[j] ([H] each)."""
    hs, xs, out = hidden, list(nxt), []
    for j in range(len(path) + 1):
        if j:
            hs, xs = torch.cat([hs, out[-1][None]]), xs + [path[j - 1]]
        out.append(head(torch.tensor([xs]), hs[None], torch.arange(len(xs))[None], None)[0, -1])
    return out


def head_drafter(kind: str, kit, head: str, target, **opts):
    """A ``kind`` drafter around the kit's head ``head`` on ``target``."""
    return create({"kind": kind, "head": kit[head], **opts}, target=target)


# ---------------------------------------------------------------------------------------------- requests, plain


def world_requests(processor, n: int, params, start: int = 0, suites=SUITES) -> list[GenerationRequest]:
    """World eval prompts start .. start + n - 1 (suite i % len(suites)), images included, as requests r{i};
    ``params`` is one SamplingParams or a list, one per request."""
    out = []
    for i in range(start, start + n):
        s = generate(suites[i % len(suites)], "eval", i)
        ids, pix = encode_prompt(processor, s.prompt, s.images)
        p = params[i - start] if isinstance(params, list) else params
        out.append(GenerationRequest(f"r{i}", ids, pix, p))
    return out


def requests(kit, n: int, params, start: int = 0, suites=SUITES) -> list[GenerationRequest]:
    """``world_requests`` with the kit's processor."""
    return world_requests(kit["processor"], n, params, start, suites)


def mixed_requests(kit, first_max: int, step: int) -> list[GenerationRequest]:
    """Five requests of sampled (T = 1, 0.8, 1) and greedy rows, request i stopping after first_max + step * i."""
    temps = [1.0, 0.0, 0.8, 1.0, 0.0]
    return requests(kit, 5, [SamplingParams(temperature=t, seed=i, max_tokens=first_max + step * i)
                             for i, t in enumerate(temps)])


def eos(kit) -> list[int]:
    return [kit["processor"].tokenizer.eos_token_id]


def plain(kit, model: str, reqs, batch: int) -> dict:
    """Plain decoding of ``reqs`` on the kit's target ``model``, ``batch`` requests at a time."""
    eng = SpecEngine(load_target(kit[model]), None, eos_token_ids=eos(kit))
    ref = {}
    for i in range(0, len(reqs), batch):
        ref.update(eng.generate(reqs[i:i + batch]))
    return ref


@dataclass
class Tally:
    """What the drafts of a run achieved: accepted and drafted tokens, and every request's tau."""

    accepted: int = 0
    drafted: int = 0
    taus: list[float] = field(default_factory=list)


def assert_equals_plain(eng: SpecEngine, reqs, ref: dict, batch: int) -> Tally:
    """Generates ``reqs`` ``batch`` at a time and asserts every output equals the plain reference token for token."""
    t = Tally()
    for i in range(0, len(reqs), batch):
        got = eng.generate(reqs[i:i + batch])
        for r in reqs[i:i + batch]:
            assert got[r.request_id].tokens == ref[r.request_id].tokens, r.request_id
            m = got[r.request_id].metrics
            t.accepted += m.accepted_tokens
            t.drafted += m.draft_tokens
            t.taus.append(m.tau)
    return t


# ---------------------------------------------------------------------------------------------- exactness plumbing


def node_paths(prop, b: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Row b of a proposal: its tokens, each node's parent (a chain: the node before) and each node's ancestors
    (node indices, root first)."""
    n = prop.counts[b]
    toks = prop.tokens[b, :n].tolist()
    parents = prop.parents[b, :n].tolist() if prop.parents is not None else list(range(-1, n - 1))
    paths = []
    for i in range(n):
        path, p = [], parents[i]
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        paths.append(path)
    return toks, parents, paths


class Checked:
    """Wraps a drafter for the engine (same spec, calls passed through); subclasses check what it proposes."""

    def __init__(self, d, target, model, reqs):
        self.d, self.target, self.model, self.spec = d, target, model, d.spec
        self.pix = {r.request_id: r.pixel_values for r in reqs}
        self.temps = {r.request_id: r.params.temperature for r in reqs}

    def begin(self, contexts):
        self.d.begin(contexts)

    def observe(self, verdicts):
        self.d.observe(verdicts)

    def release(self, ids):
        self.d.release(ids)


class FeatureChecked(Checked):
    """For heads that draft from features h^ (eagle, msd): every node's q must equal the head's softmax over a
    from-scratch recompute after the committed sequence and the node's ancestors (a greedy node: one of the top
    tokens), and the root logits must equal the recompute after every ``every``-th observe (so tails also pile up
    across steps). Subclasses give ``reference(rid)``: path tokens -> [h^_root, h^(path[0]), ...]."""

    greedy_q_one_hot = True  # also check a greedy node's q is one-hot at its token

    def __init__(self, d, target, model, reqs, every: int = 2):
        super().__init__(d, target, model, reqs)
        self.every = every
        self.checked_nodes = self.checked_roots = self.observed = 0

    def reference(self, rid):
        raise NotImplementedError

    @torch.no_grad()
    def propose(self, ids, gamma):
        prop = self.d.propose(ids, gamma)
        image = self.d.image_token_id
        for b, rid in enumerate(ids):
            features, temp = self.reference(rid), self.temps[rid]
            toks, _, paths = node_paths(prop, b)
            for i, path in enumerate(paths):
                logits = self.d.head.logits(features([toks[p] for p in path])[-1])
                logits[image] = float("-inf")
                if temp > 0:
                    torch.testing.assert_close(prop.q[b, i], torch.softmax(logits / temp, -1), atol=1e-4, rtol=0)
                else:
                    k = self.d.top_k if prop.parents is not None else 1
                    assert toks[i] in logits.topk(k).indices.tolist()
                    if self.greedy_q_one_hot:
                        assert prop.q is None or prop.q[b, i, toks[i]] == 1.0
                self.checked_nodes += 1
        return prop

    @torch.no_grad()
    def observe(self, verdicts):
        self.d.observe(verdicts)
        self.observed += 1
        if self.observed % self.every:
            return
        ids = [v.request_id for v in verdicts]
        got = self.d.root_logits(ids)  # [B, V]
        for b, rid in enumerate(ids):
            ref = self.d.head.logits(self.reference(rid)([])[0])
            torch.testing.assert_close(got[b], ref, atol=1e-4, rtol=1e-4)
            self.checked_roots += 1


def churn(target, drafter, kv_owner, reqs, gamma: int, plain_steps: tuple[int, ...]) -> int:
    """Decodes ``reqs`` through ``drafter``: three rows first, the rest joining at step 2, plain steps (gamma 0: the
    drafter only observes) at ``plain_steps``. Returns how many steps compacted ``kv_owner``'s cache."""
    eng = SpecEngine(target, drafter, gamma=gamma, eos_token_ids=[-1])
    eng.add(reqs[:3])
    compactions, steps = 0, 0
    while eng.rows:
        steps += 1
        if steps == 2:
            eng.add(reqs[3:])
        eng.gamma = 0 if steps in plain_steps else gamma
        before = kv_owner._kv.seq_len
        eng.step()
        compactions += kv_owner._kv.seq_len < before
    return compactions


# ---------------------------------------------------------------------------------------------- sampling


def assert_follows_the_target(model, drafter, base: GenerationRequest, *, target=None, n: int = 4096,
                              gamma: int = 2, max_tokens: int = 4, min_accepted: int | None = None,
                              min_rejected: int | None = None, choices: tuple | None = None) -> None:
    """The shared end-to-end distribution check (tests/runtime/distribution_check.py, docs/design.md): the first
    k = 3 tokens of n sampled copies of ``base`` through ``drafter`` (T = 1, top_k = 4) against the exact joint law
    of plain sampling on ``model``, p > 1e-4; drafts must be accepted and rejected (default n / 10 of each) so the
    check cannot pass on rejections alone. ``max_tokens`` > 3 lets a chain's second draft, or a tree's second
    level, decide token 3."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from distribution_check import chi2_test, exact_law, sample_first_tokens

    params = SamplingParams(temperature=1.0, top_k=4)
    law = exact_law(model, base, params, k=3)
    run = sample_first_tokens(model, drafter, base, params, n, 3, seed0=1_000_000, gamma=gamma,
                              max_tokens=max_tokens, target=target, choices=choices)
    result = chi2_test(run.tokens, law)
    print(f"p={result.p_value:.3g} stat={result.stat:.1f} df={result.df} accepted={run.accepted} "
          f"rejected={run.rejected}")
    assert run.accepted >= (n // 10 if min_accepted is None else min_accepted), run.accepted
    assert run.rejected >= (n // 10 if min_rejected is None else min_rejected), run.rejected
    assert result.p_value > 1e-4, result
