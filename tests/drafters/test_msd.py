"""The ``msd`` drafter on the small random LLaVA targets of ``drafter_kit`` (as test_eagle: prompts, plain-decoding
reference, chi-square), with real world prompts, most of them with images.

Heads: ``random`` (the kit's seeded random eagle head as an ``MsdHead``: its drafts depend on the whole context, images
included), ``copy`` (the kit's copy of the bigram target's layer 0: drafts its greedy tokens exactly) and
``mixed`` (that copy with its attention switched back on, so that the visual embeddings reach q). Greedy output must
equal plain decoding; every q and the cache must equal a from-scratch recompute over the committed sequence with the
target's own input embeddings at image positions; the head's input at image positions must be the raw visual
embedding (decoupled) or eagle's fc(concat(e, h)) (the ablation, which then drafts exactly like ``eagle``); sampled
output must follow the target (slow, chi-square).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from drafter_kit import (TREE, FeatureChecked, assert_equals_plain, assert_follows_the_target, churn, copy_head, eos,
                         head_drafter, layer_inputs, lively_target, mixed_requests, plain, random_head, requests,
                         )

from specula.drafters import DraftContext, Drafter, create, kinds
from specula.drafters.eagle_head import EagleHead
from specula.drafters.msd import MsdDrafter
from specula.drafters.msd_head import MsdConfig, MsdHead
from specula.training.drafters.eagle import Batch, target_features
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import PrefillRequest, load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


def as_msd(head: EagleHead, decoupled: bool = True) -> MsdHead:
    """The same weights as an ``MsdHead``."""
    msd = MsdHead(MsdConfig(**{**asdict(head.config), "decoupled": decoupled}))
    msd.load_state_dict(head.state_dict())
    return msd.eval()


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx, bigram = lively_target(processor, False), lively_target(processor, True)
    mixed = copy_head(bigram)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # attention back on: image positions (and their embeddings) now reach q
        mixed.layer.self_attn.o_proj.weight.normal_(0, 0.01, generator=g)
    eagle_random = random_head(ctx)
    return {"processor": processor, "ctx": ctx, "bigram": bigram, "eagle_random": eagle_random,
            "random": as_msd(eagle_random), "copy": as_msd(copy_head(bigram)), "mixed": as_msd(mixed)}


def drafter(kit, head: str, target, **opts) -> MsdDrafter:
    return head_drafter("msd", kit, head, target, **opts)


def test_registered_with_the_protocol(kit):
    assert "msd" in kinds()
    target = load_target(kit["ctx"])
    d = drafter(kit, "random", target)
    assert isinstance(d, Drafter) and d.spec.kind == "msd" and d.spec.needs == frozenset({"hidden", "visual"})
    assert d.decoupled and d.head._shared[1] is kit["ctx"].get_output_embeddings()
    assert not any("embed" in k or "lm_head" in k for k in d.head.state_dict())
    ablation = drafter(kit, "random", target, decoupled=False)  # reads no visual features: not asked for
    assert not ablation.decoupled and ablation.spec.needs == frozenset({"hidden"})
    trained_without = create({"kind": "msd", "head": as_msd(kit["eagle_random"], decoupled=False)}, target=target)
    assert not trained_without.decoupled  # the default follows how the head was trained


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("structure", ["chain", "tree"])
@pytest.mark.parametrize("model,head", [("ctx", "random"), ("bigram", "copy"), ("bigram", "mixed")])
def test_greedy_equals_plain_decoding(kit, model, head, structure, batch):
    reqs = requests(kit, 8, SamplingParams(max_tokens=20))
    assert sum(r.pixel_values is not None for r in reqs) >= 6
    ref = plain(kit, model, reqs, batch)
    target = load_target(kit[model])
    d = drafter(kit, head, target, structure=structure, **TREE)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, batch)
    if head != "random":
        assert t.accepted > 0
    if head == "copy":  # exact drafts (see test_eagle)
        assert min(t.taus) >= (4.0 if structure == "chain" else 2.0), t.taus
    assert not target.live_ids and not d._rows


# ---------------------------------------------------------------------------------------------- exactness


def _committed_features(model, seq: list[int], pix) -> tuple[torch.Tensor, torch.Tensor]:
    """Target hidden states [m, H] and the input embeddings its LM read [m, H] over the committed tokens."""
    ids = torch.tensor([seq])
    batch = Batch(ids, torch.ones_like(ids), pix, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    hidden, embeds = target_features(model, batch, "cpu", embeds=True)
    return hidden[0], embeds[0]


def _ref_features(head: MsdHead, hidden, embeds, xs_prev: list[int], nxt: list[int], path: list[int], image: int):
    """h^ after the committed pairs and after each draft token of ``path``, by full causal forwards from scratch (no
    cache), the head reading embeds at the committed image positions: [h^_root, h^(path[0]), ...]."""
    hs, xs, out = hidden, list(nxt), []
    m = len(nxt)
    for j in range(len(path) + 1):
        if j:
            hs, xs = torch.cat([hs, out[-1][None]]), xs + [path[j - 1]]
        n = len(xs)
        vis = torch.cat([embeds, torch.zeros(n - m, embeds.shape[1])])  # [n, H] draft positions are text
        vmask = torch.tensor(xs_prev + [0] * (n - m)) == image  # [n] x_i is an image token
        pred = head(torch.tensor([xs]), hs[None], torch.arange(n)[None], None, visual=vis[None],
                    visual_mask=vmask[None])[0]
        out.append(pred[-1])
    return out


class Checked(FeatureChecked):
    """An MsdDrafter whose proposals (every node's q) and root logits are checked against a from-scratch recompute
    over the committed sequence, with the target's own input embeddings at image positions."""

    greedy_q_one_hot = False

    def reference(self, rid):
        seq = self.target.sequence(rid)  # committed + pending
        h, e = _committed_features(self.model, seq[:-1], self.pix[rid])
        return lambda path: _ref_features(self.d.head, h, e, seq[:-1], seq[1:], path, self.d.image_token_id)


@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_cache_and_every_q_equal_a_recompute(kit, structure):
    """Rows with and without images join and leave, sampled and greedy rows share a batch, some steps are plain,
    compaction runs: q and the root always equal a from-scratch recompute that reads the visual embeddings the
    target itself read (the training-time features), so inference and training see the same inputs."""
    model = kit["ctx"]
    target = load_target(model)
    reqs = mixed_requests(kit, 8, 2)
    d = MsdDrafter(head=kit["random"], structure=structure, target=target,
                   kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0), top_k=2, depth=3, total_tokens=5,
                   quantize="none")  # the recompute runs the stock fp32 layer
    chk = Checked(d, target, model, reqs)
    compactions = churn(target, chk, d, reqs, gamma=3, plain_steps=(3, 4, 7))
    assert chk.checked_nodes > 20 and chk.checked_roots > 5 and compactions > 0
    assert not d._rows and d._kv.batch_size == 0


def _contexts(kit, target, idx: list[int], decoupled: bool = True):
    """Prefilled contexts of world prompts ``idx`` (as the engine builds them) and their requests."""
    reqs = [requests(kit, 1, SamplingParams(), start=i)[0] for i in idx]
    out = target.prefill([PrefillRequest(r.request_id, r.input_ids, r.pixel_values) for r in reqs])
    ctx = []
    for b, r in enumerate(reqs):
        vis = None
        if decoupled and r.pixel_values is not None:
            vis = target.encode_images(r.pixel_values, "projected").features  # [N_img, T_img, H]
        hidden = out.features.hidden[b, : out.features.lengths[b]]  # [L, H]
        ctx.append(DraftContext(r.request_id, r.input_ids, first_token=7, hidden=hidden, visual=vis))
    return reqs, ctx


def test_decoupling_changes_the_inputs_at_visual_positions(kit):
    """Decoupled: the layer reads the raw visual embeddings at image positions and fc(concat(e, h)) elsewhere, so an
    image prompt drafts differently from eagle and a text prompt identically. The ablation reads fc(..) everywhere
    and drafts exactly like eagle with the same weights (tokens and q, chain and tree)."""
    target = load_target(kit["ctx"])
    image = kit["ctx"].config.image_token_id
    reqs, ctx = _contexts(kit, target, [0, 2])  # r0: vqa (one image), r2: text only
    assert reqs[0].pixel_values is not None and reqs[1].pixel_values is None
    H = kit["random"].config.hidden_size
    with layer_inputs(kit["random"]) as seen:
        roots = {}
        for decoupled in (True, False):
            seen.clear()
            d = drafter(kit, "random", target, decoupled=decoupled)
            d.begin(ctx)
            x = seen[0]  # [B, L, H] the layer's input over the prompts' pairs
            for b, c in enumerate(ctx):
                n = len(c.prompt_ids)
                nxt = torch.cat([c.prompt_ids[1:], torch.tensor([c.first_token])])
                fc = kit["random"].pair_inputs(nxt[None], c.hidden[None], d._int8)[0]  # [L, H] eagle's input
                img = c.prompt_ids == image
                if decoupled and img.any():
                    assert torch.equal(x[b, :n][img], c.visual.reshape(-1, H))  # the raw embeddings, in order
                    torch.testing.assert_close(x[b, :n][~img], fc[~img])
                    assert not torch.allclose(x[b, :n][img], fc[img])
                else:
                    torch.testing.assert_close(x[b, :n], fc)
            roots[decoupled] = d.root_logits(["r0", "r2"])
    eagle = create({"kind": "eagle", "head": kit["eagle_random"]}, target=target)
    eagle.begin([DraftContext(c.request_id, c.prompt_ids, c.first_token, hidden=c.hidden) for c in ctx])
    ref = eagle.root_logits(["r0", "r2"])
    torch.testing.assert_close(roots[False], ref)
    torch.testing.assert_close(roots[True][1], ref[1])  # text only: nothing to decouple
    assert (roots[True][0] - ref[0]).abs().max() > 1e-2  # the image changes what msd drafts

    for structure in ("chain", "tree"):  # the ablation drafts exactly like eagle, sampled rows included
        props = []
        for kind, head in (("eagle", "eagle_random"), ("msd", "random")):
            opts = {"decoupled": False} if kind == "msd" else {}
            d = create({"kind": kind, "head": kit[head], "structure": structure, **TREE, **opts}, target=target)
            d._generator = lambda c: torch.Generator().manual_seed(11)  # one draw stream for both kinds
            d.begin([DraftContext(c.request_id, c.prompt_ids, c.first_token, temperature=t, seed=4, hidden=c.hidden)
                     for c, t in zip(ctx, (1.0, 0.0))])
            props.append(d.propose(["r0", "r2"], gamma=4))
        assert torch.equal(props[0].tokens, props[1].tokens) and props[0].counts == props[1].counts
        torch.testing.assert_close(props[0].q, props[1].q)
    target.release(["r0", "r2"])


def test_bad_config_is_refused(kit, tmp_path):
    target = load_target(kit["ctx"])
    for opts, match in [({"decoupled": "yes"}, "decoupled"), ({"structure": "graph"}, "structure"),
                        ({"top_k": 0}, "top_k"), ({"branching": 3}, "unknown"), ({"dtype": "float33"}, "dtype")]:
        with pytest.raises(ValueError, match=match):
            drafter(kit, "random", target, **opts)
    with pytest.raises(ValueError, match="MsdHead"):
        create({"kind": "msd", "head": kit["eagle_random"]}, target=target)
    with pytest.raises(ValueError, match="no msd.safetensors"):
        create({"kind": "msd", "path": str(tmp_path)}, target=target)
    with pytest.raises(ValueError, match="decoupled"):
        MsdConfig(**{**asdict(kit["random"].config), "decoupled": 1})
    with pytest.raises(ValueError, match="MsdConfig"):
        MsdHead(kit["eagle_random"].config)
    reqs, ctx = _contexts(kit, target, [0])
    c = ctx[0]
    d = drafter(kit, "random", target)
    for bad in (None, c.visual[:, :-1], c.visual[..., :-1]):  # no visual features, too few tokens, wrong width
        with pytest.raises(ValueError, match="visual embeddings"):
            d.begin([DraftContext(c.request_id, c.prompt_ids, c.first_token, hidden=c.hidden, visual=bad)])
    assert not d._rows  # nothing was half-begun
    target.release(["r0"])


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_sampled_tokens_follow_the_target(kit, structure):
    """The shared distribution check (exact joint of the first 3 tokens) on an image prompt with the decoupled
    ``mixed`` head."""
    base = requests(kit, 1, SamplingParams(), start=0)[0]
    assert base.pixel_values is not None
    target = load_target(kit["bigram"])
    d = drafter(kit, "mixed", target, structure=structure, top_k=3, depth=2, total_tokens=5, seed=3)
    assert_follows_the_target(kit["bigram"], d, base, target=target, max_tokens=4 if structure == "chain" else 7)