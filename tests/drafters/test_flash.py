"""The ``flash`` drafter on the small random LLaVA targets of ``drafter_kit`` (as test_eagle: world prompts, most
with images, the plain-decoding reference, chi-square), heads built from the kit's eagle heads:

``random`` (a seeded random FlashHead: drafts depend on the whole context, compressed images included, k = 3),
``copy1`` / ``copy`` (the copy of the bigram target's layer 0 with k = 1 / 3: its first offset drafts the greedy
token exactly), ``mixed`` (that copy with attention and offsets switched on: images reach q, each offset differs).
Greedy output must equal plain decoding; every q must equal a from-scratch recompute over the committed sequence
(the target's own hidden states, each image compressed to m tokens) and the chain's earlier passes; sampled output
must follow the target (slow, chi-square).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from drafter_kit import (Checked, assert_equals_plain, assert_follows_the_target, churn, copy_head, eos, head_drafter,
                         layer_inputs, lively_target, mixed_requests, plain, random_head, requests)

from specula.drafters import DraftContext, Drafter, create, kinds
from specula.drafters.flash import FlashDrafter
from specula.drafters.flash_head import FlashConfig, FlashHead, draft_inputs, layout
from specula.drafters.protocol import supports_lookahead
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import PrefillRequest, load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

M = 8  # compressed tokens per image in these tests (the tiny target has 144 per image)


def as_flash(head, k: int, std: float = 0.0, seed: int = 5) -> FlashHead:
    """The weights of an EagleHead as a FlashHead with k offsets (zero, or random with ``std``) and seeded
    queries."""
    cfg = FlashConfig(**{**asdict(head.config), "tokens_per_pass": k, "visual_tokens": M, "image_tokens": 144})
    flash = FlashHead(cfg)
    missing, unexpected = flash.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(n.startswith(("queries", "offsets")) for n in missing)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        flash.queries.normal_(0, 1, generator=g)
        for lin in flash.offsets:
            lin.weight.normal_(0, std, generator=g)
    return flash.eval()


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx, bigram = lively_target(processor, False), lively_target(processor, True)
    mixed = copy_head(bigram)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # attention back on: the compressed images reach q
        mixed.layer.self_attn.o_proj.weight.normal_(0, 0.01, generator=g)
    mixed = as_flash(mixed, 2, 0.2)
    with torch.no_grad():  # offset 1 stays the copy (q_1 close to p); offset 2 reads o through its own block
        mixed.offsets[0].weight.zero_()
    return {"processor": processor, "ctx": ctx, "bigram": bigram, "random": as_flash(random_head(ctx), 3, 0.1),
            "copy1": as_flash(copy_head(bigram), 1), "copy": as_flash(copy_head(bigram), 3), "mixed": mixed}


def drafter(kit, head: str, target, **opts) -> FlashDrafter:
    return head_drafter("flash", kit, head, target, **opts)


def test_registered_with_the_protocol(kit):
    assert "flash" in kinds()
    target = load_target(kit["ctx"])
    d = drafter(kit, "random", target)
    assert isinstance(d, Drafter) and d.spec.kind == "flash" and d.spec.needs == frozenset({"hidden", "visual"})
    assert d.spec.structure == "chain" and d.k == 3 and not supports_lookahead(d)
    assert d.head._shared[1] is kit["ctx"].get_output_embeddings()
    assert not any("embed" in k or "lm_head" in k for k in d.head.state_dict())
    assert drafter(kit, "random", target, tokens_per_pass=1).k == 1


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model,head", [("ctx", "random"), ("bigram", "copy1"), ("bigram", "copy"),
                                        ("bigram", "mixed")])
def test_greedy_equals_plain_decoding(kit, model, head, batch):
    reqs = requests(kit, 8, SamplingParams(max_tokens=20))
    assert sum(r.pixel_values is not None for r in reqs) >= 6
    ref = plain(kit, model, reqs, batch)
    target = load_target(kit[model])
    d = drafter(kit, head, target)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, batch)
    if head != "random":
        assert t.accepted > 0
    if head == "copy1":  # k = 1 is EAGLE's chain: exact drafts, every block accepted whole (the last may be cut)
        assert min(t.taus) >= 4.0, t.taus
    assert not target.live_ids and not d._rows


def test_the_vision_tower_runs_once_for_target_and_drafter(kit):
    """A drafter that needs the projected visual features gets the very features the prefill consumes, from one
    tower pass over the batch's images (the engine encodes them once and hands them to both), not a second pass."""
    reqs = [r for r in requests(kit, 8, SamplingParams(max_tokens=6)) if r.pixel_values is not None][:3]
    ref = plain(kit, "ctx", reqs, len(reqs))
    target = load_target(kit["ctx"])
    d = drafter(kit, "random", target)
    begin = d.begin
    d.begin = lambda cs: (seen.extend(cs), begin(cs))[1]
    model = target.model.model  # the kit's model object: patched for this test only
    tower = model.get_image_features
    passes, seen = [], []
    model.get_image_features = lambda *a, **k: (passes.append(1), tower(*a, **k))[1]
    try:
        out = SpecEngine(target, d, gamma=3, eos_token_ids=eos(kit)).generate(reqs)
    finally:
        del model.get_image_features  # the class's method again
    assert {k: v.tokens for k, v in out.items()} == {k: v.tokens for k, v in ref.items()}
    assert len(passes) == 1  # one batch of prompts: one tower pass, shared
    for c, r in zip(seen, reqs):
        want = target.encode_images(r.pixel_values, "projected").features
        torch.testing.assert_close(c.visual, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- exactness


def _draft_sequence(head: FlashHead, model, target, seq: list[int], pix) -> torch.Tensor:
    """The draft inputs [L', H] over the committed pairs of ``seq`` (committed tokens + the pending one), from
    scratch: the target's hidden states, its projected visual embeddings compressed."""
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([seq[:-1]]), pixel_values=pix).last_hidden_state[0]  # [m, H]
        pairs = head.pair_inputs(torch.tensor([seq[1:]]), h[None])[0]  # [m, H]
        cfg = head.config
        lay = layout(torch.tensor(seq[:-1]), cfg.image_token_id, cfg.image_tokens, cfg.visual_tokens)
        comp = None
        if pix is not None:
            comp = head.compress(target.encode_images(pix, "projected").features)  # [N_img, m, H]
        return draft_inputs(head, pairs, comp, lay)


class FlashChecked(Checked):
    """A FlashDrafter whose every q is checked against a recompute: passes of k over full causal forwards."""

    def __init__(self, d: FlashDrafter, target, model, reqs):
        super().__init__(d, target, model, reqs)
        self.checked = 0

    @torch.no_grad()
    def propose(self, ids, gamma):
        prop = self.d.propose(ids, gamma)
        head, k = self.d.head, self.d.k
        for b, rid in enumerate(ids):
            x = _draft_sequence(head, self.model, self.target, self.target.sequence(rid), self.pix[rid])  # [L', H]
            toks, temp = prop.tokens[b, : prop.counts[b]].tolist(), self.temps[rid]
            for p0 in range(0, len(toks), k):
                o = head.decode(x[None], torch.arange(len(x))[None], None)[0, -1]  # [H] from scratch
                feats = head.expand(o)[: len(toks[p0:p0 + k])]  # [n, H]
                logits = head.logits(feats)
                logits[:, self.d.image_token_id] = float("-inf")
                for j, t in enumerate(toks[p0:p0 + k]):
                    if temp > 0:
                        torch.testing.assert_close(prop.q[b, p0 + j], torch.softmax(logits[j] / temp, -1),
                                                   atol=1e-4, rtol=0)
                    else:
                        assert t == int(logits[j].argmax()) and (prop.q is None or prop.q[b, p0 + j, t] == 1)
                    self.checked += 1
                new = head.pair_inputs(torch.tensor([toks[p0:p0 + k]]), feats[None])[0]  # the pass's pairs
                x = torch.cat([x, new])
        return prop


def test_every_q_equals_a_recompute(kit):
    """Rows with and without images join and leave, sampled and greedy rows share a batch, some steps are plain,
    compaction runs, gamma is not a multiple of k: every q equals a from-scratch recompute."""
    model = kit["ctx"]
    target = load_target(model)
    reqs = mixed_requests(kit, 8, 2)
    d = FlashDrafter(head=kit["random"], target=target, tokens_per_pass=2,
                     kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0), quantize="none")  # recompute: stock fp32
    chk = FlashChecked(d, target, model, reqs)
    compactions = churn(target, chk, d, reqs, gamma=5, plain_steps=(3, 4))
    assert chk.checked > 40 and compactions > 0
    assert not d._rows and d._kv.batch_size == 0


def test_images_are_compressed_to_m_latent_tokens(kit):
    """An image prompt's draft sequence is L - N_img (T_img - m) long; the layer reads eq. 3's compressed tokens
    at each image's m slots and EAGLE pairs elsewhere; a text prompt is EAGLE's sequence."""
    target = load_target(kit["ctx"])
    reqs = [requests(kit, 1, SamplingParams(), start=i)[0] for i in (0, 2, 3)]  # vqa, text, multi_image
    out = target.prefill([PrefillRequest(r.request_id, r.input_ids, r.pixel_values) for r in reqs])
    image = kit["ctx"].config.image_token_id
    head = kit["random"]
    ctx = []
    for b, r in enumerate(reqs):
        vis = None if r.pixel_values is None else target.encode_images(r.pixel_values, "projected").features
        ctx.append(DraftContext(r.request_id, r.input_ids, 7, hidden=out.features.hidden[b, : len(r.input_ids)],
                                visual=vis))
    with layer_inputs(head) as seen:
        d = drafter(kit, "random", target)
        d.begin(ctx)
    x = seen[0]  # [B, L', H]
    for b, c in enumerate(ctx):
        n_img = int((c.prompt_ids == image).sum()) // 144
        assert d._rows[c.request_id].next_pos == len(c.prompt_ids) - n_img * (144 - M)
        lay = layout(c.prompt_ids, image, 144, M)
        nxt = torch.cat([c.prompt_ids[1:], torch.tensor([7])])
        pairs = head.pair_inputs(nxt[None], c.hidden[None], d._int8)[0]  # the drafter's own fc weights
        torch.testing.assert_close(x[b, lay.text_slot], pairs[lay.text_pos])
        if n_img:
            torch.testing.assert_close(x[b, lay.image_slot.flatten()], head.compress(c.visual).reshape(-1, 64))
    assert (reqs[0].pixel_values is not None and reqs[1].pixel_values is None
            and reqs[2].pixel_values is not None and reqs[2].pixel_values.shape[0] >= 2)
    target.release([r.request_id for r in reqs])


def test_a_stop_token_ends_the_chain(kit):
    """A drafted stop token (EOS by default) ends its chain, and no further pass runs once every chain has ended;
    greedy output still equals plain decoding."""
    target = load_target(kit["ctx"])
    reqs = [requests(kit, 1, SamplingParams(), start=i)[0] for i in (0, 2)]
    out = target.prefill([PrefillRequest(r.request_id, r.input_ids, r.pixel_values) for r in reqs])
    ctx = [DraftContext(r.request_id, r.input_ids, 7, hidden=out.features.hidden[b, : len(r.input_ids)],
                        visual=None if r.pixel_values is None else
                        target.encode_images(r.pixel_values, "projected").features) for b, r in enumerate(reqs)]
    free = drafter(kit, "random", target, stop_token_ids=[])
    free.begin(ctx)
    chain = free.propose([r.request_id for r in reqs], gamma=6)  # two passes of 3
    stop = int(chain.tokens[0, 1])
    rows = [chain.tokens[b].tolist() for b in range(2)]
    n = [row.index(stop) + 1 if stop in row else 6 for row in rows]  # up to the first stop token
    cut = drafter(kit, "random", target, stop_token_ids=[stop])
    cut.begin(ctx)
    got = cut.propose([r.request_id for r in reqs], gamma=6)
    assert list(got.counts) == n and got.tokens.shape[1] == (3 if max(n) <= 3 else 6)  # a pass drafts k = 3
    assert all(got.tokens[b, : n[b]].tolist() == rows[b][: n[b]] for b in range(2))
    bigram = load_target(kit["bigram"])
    reqs = requests(kit, 4, SamplingParams(max_tokens=16))
    ref = plain(kit, "bigram", reqs, 2)
    d = drafter(kit, "copy", bigram, stop_token_ids=[ref["r0"].tokens[3]])
    assert_equals_plain(SpecEngine(bigram, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 2)


def test_layout_places_whole_images():
    ids = torch.tensor([5, 9, 9, 9, 9, 9, 9, 6, 9, 9, 9, 7])  # images of 3 tokens: two adjacent, one later
    lay = layout(ids, 9, 3, 2)
    assert lay.length == 12 - 3 * (3 - 2)
    assert lay.text_pos.tolist() == [0, 7, 11] and lay.text_slot.tolist() == [0, 5, 8]
    assert lay.image_slot.tolist() == [[1, 2], [3, 4], [6, 7]]
    for bad in ([5, 9, 9, 6, 9, 7], [9, 9, 9, 9, 6, 9, 9]):  # runs that are not whole images
        with pytest.raises(ValueError, match="image"):
            layout(torch.tensor(bad), 9, 3, 2)


def test_bad_config_is_refused(kit, tmp_path):
    target = load_target(kit["ctx"])
    for opts, match in [({"structure": "tree"}, "chain"), ({"tokens_per_pass": 4}, "tokens_per_pass"),
                        ({"tokens_per_pass": 0}, "tokens_per_pass"), ({"top_k": 2}, "unknown"),
                        ({"branching": 3}, "unknown"), ({"dtype": "float33"}, "dtype")]:
        with pytest.raises(ValueError, match=match):
            drafter(kit, "random", target, **opts)
    with pytest.raises(ValueError, match="no flash.safetensors"):
        create({"kind": "flash", "path": str(tmp_path)}, target=target)
    base = asdict(kit["random"].config)
    for field, value in [("tokens_per_pass", 0), ("visual_tokens", 200), ("image_tokens", 0)]:
        with pytest.raises(ValueError, match=field if field != "visual_tokens" else "visual_tokens"):
            FlashConfig(**{**base, field: value})
    r = requests(kit, 1, SamplingParams(), start=0)[0]
    out = target.prefill([PrefillRequest("r0", r.input_ids, r.pixel_values)])
    vis = target.encode_images(r.pixel_values, "projected").features
    d = drafter(kit, "random", target)
    for bad in (None, vis[:, :-1], vis[..., :-1]):
        with pytest.raises(ValueError, match="visual embeddings"):
            d.begin([DraftContext("r0", r.input_ids, 7, hidden=out.features.hidden[0], visual=bad)])
    with pytest.raises(ValueError, match="hidden"):
        d.begin([DraftContext("r0", r.input_ids, 7, visual=vis)])
    assert not d._rows
    target.release(["r0"])


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.statistical
def test_sampled_tokens_follow_the_target(kit):
    """The shared distribution check (exact joint of the first 3 tokens) on an image prompt with ``mixed`` (k = 2:
    d_2 of each pass is drawn from q_2 without seeing d_1). End to end only; ``test_every_q_equals_a_recompute``
    is what pins each offset's q."""
    base = requests(kit, 1, SamplingParams(), start=0)[0]
    assert base.pixel_values is not None
    target = load_target(kit["bigram"])
    assert_follows_the_target(kit["bigram"], drafter(kit, "mixed", target, seed=3), base, target=target)