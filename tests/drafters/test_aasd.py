"""The ``aasd`` drafter on the small random LLaVA targets of ``drafter_kit`` (as test_eagle: world prompts, most
with images, the plain-decoding reference, chi-square).

Heads: ``random`` (seeded random weights and KV projector: drafts depend on the target's whole cache, compressed
images included), ``copy`` (the bigram target's layer 0 and final norm: with attention off there, it computes the
target's own final hidden state from the token, so it drafts the greedy tokens exactly) and ``mixed`` (that copy with
attention switched on, so the target's KV reaches q). Greedy output must equal plain decoding; every q must equal a
from-scratch recompute (the target's last-layer K/V of the committed sequence from a full forward, images
compressed, then the chain's own K/V); sampled output must follow the target (slow, chi-square).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from drafter_kit import (Checked, assert_equals_plain, assert_follows_the_target, churn, eos, head_drafter, lively_target,
                         mixed_requests, plain, requests)
from transformers import DynamicCache

from specula.drafters import DraftContext, Drafter, Verdict, create, kinds
from specula.drafters.aasd import AasdDrafter
from specula.drafters.aasd_head import AasdConfig, AasdHead, context_kv, image_spans
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import PrefillRequest, load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

KV = 8  # compressed entries per image in these tests (the tiny target has 144 image tokens per image)


def _head(model, copy: bool, std: float = 0.1, attn: float = 0.0) -> AasdHead:
    head = AasdHead(AasdConfig.from_target(model, kv_tokens=KV))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if copy:  # the bigram target's layer 0 (no attention) and final norm: h^ = the target's h
            lm = model.model.language_model
            head.layer.load_state_dict(lm.layers[0].state_dict())
            head.norm.load_state_dict(lm.norm.state_dict())
            head.layer.self_attn.o_proj.weight.normal_(0, attn, generator=g)
        else:
            for name, p in head.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, std, generator=g)
            head.w_k.abs_()
            head.w_v.abs_()
    head.attach(model.get_input_embeddings(), model.get_output_embeddings())
    return head.eval()


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx, bigram = lively_target(processor, False), lively_target(processor, True)
    return {"processor": processor, "ctx": ctx, "bigram": bigram, "random": _head(ctx, False),
            "copy": _head(bigram, True), "mixed": _head(bigram, True, attn=0.003)}


def drafter(kit, head: str, target, **opts) -> AasdDrafter:
    return head_drafter("aasd", kit, head, target, **opts)


def test_registered_with_the_protocol(kit):
    assert "aasd" in kinds()
    d = drafter(kit, "random", load_target(kit["ctx"]))
    assert isinstance(d, Drafter) and d.spec.kind == "aasd" and d.spec.needs == frozenset({"last_kv"})
    assert d.spec.structure == "chain" and d.head._shared[1] is kit["ctx"].get_output_embeddings()
    assert not any("embed" in k or "lm_head" in k for k in d.head.state_dict())
    assert tuple(d.head.w_k.shape) == (KV, 144)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model,head", [("ctx", "random"), ("bigram", "copy"), ("bigram", "mixed")])
def test_greedy_equals_plain_decoding(kit, model, head, batch):
    reqs = requests(kit, 8, SamplingParams(max_tokens=20))
    assert sum(r.pixel_values is not None for r in reqs) >= 6
    ref = plain(kit, model, reqs, batch)
    target = load_target(kit[model])
    d = drafter(kit, head, target)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, batch)
    if head != "random":
        assert t.accepted > 0
    if head == "copy":  # exact drafts: every block accepted whole (the last may be cut at max_tokens)
        assert min(t.taus) >= 4.0, t.taus
    assert not target.live_ids and not d._rows


# ---------------------------------------------------------------------------------------------- exactness


def reference_chain(head: AasdHead, model, seq: list[int], pix, chain: list[int]) -> torch.Tensor:
    """h^ [len(chain), H] of a chain fed from the pending token: ``seq`` = committed tokens + the pending one,
    ``chain`` = [pending, d_1, ..]; the context is the target's last-layer K/V from a full forward over the committed
    tokens (images compressed), then the chain's own K/V, causal."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([seq[:-1]]), pixel_values=pix, use_cache=True)
        layer = out.past_key_values.layers[-1]
        k, v, _ = context_kv(head, torch.tensor(seq[:-1]), layer.keys[0], layer.values[0])  # [H_kv, S, D]
        cache = DynamicCache(config=head.llama_config)
        cache.update(k[None], v[None], 0)
        n, s = len(chain), k.shape[1]
        allowed = torch.cat([torch.ones(n, s, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        pos = torch.arange(len(seq) - 1, len(seq) - 1 + n)[None]
        return head(torch.tensor([chain]), pos, allowed[None, None], cache)[0]


class AasdChecked(Checked):
    """An AasdDrafter whose every q is checked against ``reference_chain``."""

    def __init__(self, d: AasdDrafter, target, model, reqs):
        super().__init__(d, target, model, reqs)
        self.checked = 0

    @torch.no_grad()
    def propose(self, ids, gamma):
        prop = self.d.propose(ids, gamma)
        for b, rid in enumerate(ids):
            seq, temp = self.target.sequence(rid), self.temps[rid]
            toks = prop.tokens[b, : prop.counts[b]].tolist()
            h = reference_chain(self.d.head, self.model, seq, self.pix[rid], [seq[-1]] + toks[:-1])
            logits = self.d.head.logits(h)  # [gamma, V]
            logits[:, self.d.image_token_id] = float("-inf")
            for j, t in enumerate(toks):
                if temp > 0:
                    torch.testing.assert_close(prop.q[b, j], torch.softmax(logits[j] / temp, -1), atol=1e-4, rtol=0)
                else:
                    assert t == int(logits[j].argmax()) and (prop.q is None or prop.q[b, j, t] == 1)
                self.checked += 1
        return prop

    def observe(self, verdicts):
        for v in verdicts:  # the engine hands over the target's last-layer K/V of the committed positions
            n = 1 + len(v.accepted)
            assert v.extra["last_k"].shape[1] == n and v.extra["last_v"].shape[1] == n
        self.d.observe(verdicts)


def test_every_q_equals_a_recompute(kit):
    """Rows with and without images join and leave, sampled and greedy rows share a batch, some steps are plain
    (the verdict's K/V still joins the context), compaction runs: every q equals the from-scratch recompute."""
    model = kit["ctx"]
    target = load_target(model)
    reqs = mixed_requests(kit, 8, 2)
    d = AasdDrafter(head=kit["random"], target=target, kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0),
                    quantize="none")  # the recompute runs the stock fp32 layer
    chk = AasdChecked(d, target, model, reqs)
    compactions = churn(target, chk, d, reqs, gamma=3, plain_steps=(3, 4, 7))
    assert chk.checked > 30 and compactions > 0
    assert not d._rows and d._kv.batch_size == 0


def _contexts(kit, target, idx: list[int]):
    reqs = [requests(kit, 1, SamplingParams(), start=i)[0] for i in idx]
    out = target.prefill([PrefillRequest(r.request_id, r.input_ids, r.pixel_values) for r in reqs])
    ctx = []
    for b, r in enumerate(reqs):
        n = len(r.input_ids)
        extra = {"last_k": out.features.last_k[b, :, :n], "last_v": out.features.last_v[b, :, :n]}
        ctx.append(DraftContext(r.request_id, r.input_ids, first_token=7, extra=extra))
    return reqs, ctx


def test_a_stop_token_ends_the_chain(kit):
    """A drafted stop token (EOS by default) ends its chain; drafting stops once every chain has ended."""
    target = load_target(kit["ctx"])
    assert drafter(kit, "random", target).stop_ids.tolist() == list(target.info.eos_token_ids)
    _, ctx = _contexts(kit, target, [0, 1])
    free = drafter(kit, "random", target, stop_token_ids=[])
    free.begin(ctx)
    chain = free.propose(["r0", "r1"], gamma=5)
    assert chain.counts == (5, 5)
    stop = int(chain.tokens[0, 1])
    rows = [chain.tokens[b].tolist() for b in range(2)]
    n = [row.index(stop) + 1 if stop in row else 5 for row in rows]  # up to the first stop token
    cut = drafter(kit, "random", target, stop_token_ids=[stop])
    cut.begin(ctx)
    got = cut.propose(["r0", "r1"], gamma=5)
    assert list(got.counts) == n and got.tokens.shape[1] == max(n)  # no step after every chain ended
    assert all(got.tokens[b, : n[b]].tolist() == rows[b][: n[b]] for b in range(2))
    assert cut._rows["r0"].draft == rows[0][: n[0]]


def test_image_kv_is_compressed_by_the_projector(kit):
    """Each image's 144 cached entries become KV entries W_K K_I / W_V V_I; text entries are the target's own."""
    target = load_target(kit["ctx"])
    image = kit["ctx"].config.image_token_id
    reqs, ctx = _contexts(kit, target, [0, 2, 3])  # one image, text only, several images
    d = drafter(kit, "random", target)
    d.begin(ctx)
    head = d.head
    for b, c in enumerate(ctx):
        n_img = int((c.prompt_ids == image).sum()) // 144
        assert len(image_spans(c.prompt_ids, image, 144)) == n_img
        valid = d._kv.valid[b]
        assert int(valid.sum()) == len(c.prompt_ids) - n_img * (144 - KV)
        k_all = d._kv.cache.layers[0].keys[b][:, valid]  # [H_kv, S, D]
        text = c.prompt_ids != image
        s = torch.nonzero(c.prompt_ids == image).flatten()
        if n_img:
            first = int(s[0])
            ck, _ = head.compress(c.extra["last_k"][:, first:first + 144], c.extra["last_v"][:, first:first + 144])
            torch.testing.assert_close(k_all[:, first:first + KV], ck)
            torch.testing.assert_close(k_all[:, :first], c.extra["last_k"][:, :first])
        else:
            torch.testing.assert_close(k_all, c.extra["last_k"][:, text])
    assert n_img >= 2
    target.release([r.request_id for r in reqs])


def test_bad_input_is_refused(kit, tmp_path):
    target = load_target(kit["ctx"])
    for opts, match in [({"structure": "tree"}, "chain"), ({"seed": -1}, "seed"), ({"top_k": 3}, "unknown"),
                        ({"dtype": "float33"}, "dtype"), ({"stop_token_ids": "2"}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            drafter(kit, "random", target, **opts)
    with pytest.raises(ValueError, match="no aasd.safetensors"):
        create({"kind": "aasd", "path": str(tmp_path)}, target=target)
    with pytest.raises(ValueError, match="target"):
        create({"kind": "aasd", "head": AasdHead(kit["random"].config)})
    with pytest.raises(ValueError, match="kv_tokens"):
        AasdConfig(**{**asdict(kit["random"].config), "kv_tokens": 0})
    with pytest.raises(ValueError, match="AasdConfig"):
        AasdHead(object())
    reqs, ctx = _contexts(kit, target, [0])
    c = ctx[0]
    d = drafter(kit, "random", target)
    for extra in ({}, {"last_k": c.extra["last_k"][:, :-1], "last_v": c.extra["last_v"][:, :-1]}):
        with pytest.raises(ValueError, match="last_k"):
            d.begin([DraftContext("r0", c.prompt_ids, 7, extra=extra)])
    assert not d._rows
    d.begin([c])
    prop = d.propose(["r0"], gamma=2)
    with pytest.raises(ValueError, match="last_k"):
        d.observe([Verdict("r0", (0,), (int(prop.tokens[0, 0]),), 5)])
    with pytest.raises(ValueError, match="differ"):
        d.observe([Verdict("r0", (0,), (int(prop.tokens[0, 0]) + 1,), 5)])
    with pytest.raises(ValueError, match="not observed"):
        d.propose(["r0"], gamma=2)
    with pytest.raises(ValueError, match="whole"):
        image_spans(torch.tensor([5, 9, 9, 6, 9]), 9, 3)
    target.release(["r0"])


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.statistical
def test_sampled_tokens_follow_the_target(kit):
    """The shared distribution check (exact joint of the first 3 tokens) on an image prompt with ``mixed``."""
    base = requests(kit, 1, SamplingParams(), start=0)[0]
    assert base.pixel_values is not None
    target = load_target(kit["bigram"])
    assert_follows_the_target(kit["bigram"], drafter(kit, "mixed", target, seed=3), base, target=target)


def test_the_target_kv_crosses_the_data_plane(kit):
    """Drafter in a DrafterServer, verifier across real gRPC on 127.0.0.1: the prompt's and every verdict's
    last-layer K/V reach the remote drafter (it would refuse a verdict without them and the verifier would decode
    alone), so it drafts as in one process and the output is plain decoding's."""
    from specula.runtime.dataplane import DrafterServer, RemoteDrafter
    from specula.runtime.serve.verifier import VerifierEngine

    reqs = requests(kit, 3, SamplingParams(max_tokens=16))
    ref = plain(kit, "bigram", reqs, 1)
    single = SpecEngine(load_target(kit["bigram"]), drafter(kit, "mixed", load_target(kit["bigram"])), gamma=3,
                        eos_token_ids=eos(kit))
    target = load_target(kit["bigram"])
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=30.0,
                                                    connect_timeout_s=5.0), gamma=3,
                              eos_token_ids=eos(kit))
    try:
        with DrafterServer(drafter(kit, "mixed", load_target(kit["bigram"]))) as server:
            for r in reqs:
                got = verifier.generate(r, drafter_address=server.address)
                want = single.generate([r])[r.request_id]
                assert got["tokens"] == ref[r.request_id].tokens and got["drafter"] == "ok", r.request_id
                assert got["metrics"]["accepted_tokens"] == want.metrics.accepted_tokens > 0
    finally:
        verifier.close()
