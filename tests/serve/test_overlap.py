"""Post-verify overlap (PEARL) on the data plane: a DrafterServer drafts block n+1 while the verifier verifies block n.

Real gRPC on 127.0.0.1, tiny random LLaVA targets with the world's tokenizer. Two targets: ``repetitive_model_dir`` (init
weights: every answer repeats one token, so blocks are accepted whole and pre-drafted blocks are used) and
``lively`` (large weights: answers vary, drafts are mostly rejected, pre-drafted blocks are dropped). Greedy output
must equal plain decoding for every drafter that drafts ahead (ngram, text_lm, eagle chains and trees, the IbED ensemble), batched; with a seed, ngram
gives the same sampled tokens with overlap on and off (its drafts are a function of the committed tokens, so the
verifier's generator is consumed identically); for text_lm every sampled block's q, pre-drafted ones included,
must be the drafter's true law given the committed sequence.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

from specula.drafters import create
from specula.drafters.eagle_head import EagleConfig, EagleHead
from specula.drafters.protocol import DraftContext, Verdict, supports_lookahead
from specula.runtime.dataplane import DrafterServer, RemoteDrafter
from specula.runtime.dataplane.overlap import Pipeline
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.verifier import VerifierEngine
from specula.targets import load_target

from serve_kit import world_requests


@pytest.fixture(scope="module")
def lively(tmp_path_factory, processor):
    from specula.zoo.store import TOKENIZER_DIR  # noqa: F401  (the processor fixture already resolved it)
    from specula.targets.embedded_arch import TargetArch, build_model

    out = tmp_path_factory.mktemp("lively_llava")
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the init: answers vary instead of repeating one token
        for p in model.model.language_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _text_lm(model_dir):
    """The target's own language model, images dropped: exact on text prompts, off on image prompts."""
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    lm = LlamaForCausalLM(hf.config.text_config)
    lm.model.load_state_dict(hf.model.language_model.state_dict())
    lm.lm_head.weight.data.copy_(hf.lm_head.weight.data)
    # exact only with the fp32 weights (int8 drafting weights would make it a near copy)
    return create({"kind": "text_lm", "model": lm.eval(), "quantize": "none"}, target=load_target(model_dir))


def _noisy_text_lm(model_dir, scale: float = 0.05):
    """``_text_lm`` with a little noise on its matrices: where it is wrong the target's token is often its
    runner-up."""
    drafter = _text_lm(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return drafter


def _eagle(model_dir, **opts):
    """A head that passes h_i through (fc = [0 | I], its layer the identity): it drafts the target's last choice."""
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    head = EagleHead(EagleConfig.from_target(hf))
    h = head.config.hidden_size
    with torch.no_grad():
        head.fc.bias.zero_()
        head.fc.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return create({"kind": "eagle", "head": head.eval(), **opts}, target=load_target(model_dir))


def _eagle_tree(model_dir):
    """``_eagle`` drafting EAGLE-2 trees: it drafts ahead along the tree's spine (its first child at each level)."""
    return _eagle(model_dir, structure="tree", top_k=2, depth=4, total_tokens=8)


def _ensemble(model_dir):
    """IbED over the target's own LM and projector (a MassvModel over its pre-projector features): a multimodal
    member (the target itself) and a text-only member, mixed; two rows per image request, one per text request."""
    from specula.drafters.massv_model import MassvConfig, MassvModel

    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    lm = LlamaForCausalLM(hf.config.text_config)
    lm.model.load_state_dict(hf.model.language_model.state_dict())
    lm.lm_head.weight.data.copy_(hf.lm_head.weight.data)
    m = MassvModel(lm, MassvConfig(feature_dim=hf.config.vision_config.hidden_size,
                                   image_token_id=hf.config.image_token_id))
    m.projector[0].load_state_dict(hf.model.multi_modal_projector.linear_1.state_dict())
    m.projector[2].load_state_dict(hf.model.multi_modal_projector.linear_2.state_dict())
    return create({"kind": "ensemble", "model": m.eval(), "members": ["multimodal", "text"], "quantize": "none",
                   "join": "at_once"},
                  target=load_target(model_dir))


DRAFTERS = {"ngram": lambda d: create({"kind": "ngram", "max_n": 3}), "text_lm": _text_lm, "eagle": _eagle,
            "eagle_tree": _eagle_tree, "ensemble": _ensemble}


def _verifier(model_dir, gamma=4, **remote) -> VerifierEngine:
    target = load_target(model_dir)
    return VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=30.0, **remote),
                          gamma=gamma)


def _serve_batch(target, drafter, reqs, **remote) -> dict:
    """``reqs`` at once through a VerifierEngine over ``target`` and a DrafterServer (overlap, predraft 3)."""
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=30.0,
                                                    **remote), gamma=4)
    try:
        with DrafterServer(drafter, overlap=True, predraft=3) as server:
            return _run_batch(verifier, reqs, server.address)
    finally:
        verifier.close()


def _run_batch(verifier, reqs, address) -> dict:
    """All requests at once (they share the verifier's batch and the drafter server)."""
    got = {}

    def one(r):
        got[r.request_id] = verifier.generate(r, drafter_address=address)

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


@pytest.mark.parametrize("kind", ["ngram", "text_lm", "eagle", "eagle_tree", "ensemble"])
def test_greedy_overlap_equals_plain_decoding_batched(repetitive_model_dir, lively, processor, kind):
    settled = 0
    for d in (repetitive_model_dir, lively):
        reqs = world_requests(processor, 3, SamplingParams(max_tokens=20))
        plain = SpecEngine(load_target(d), None)
        want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
        drafter = DRAFTERS[kind](d)
        assert supports_lookahead(drafter)
        verifier = _verifier(d)
        try:
            with DrafterServer(drafter, overlap=True, predraft=3) as server:
                got = _run_batch(verifier, reqs, server.address)
        finally:
            verifier.close()
        assert {rid: g["tokens"] for rid, g in got.items()} == want, (kind, d.name)
        stats = [g["dataplane"] for g in got.values()]
        assert all(g["drafter"] == "ok" for g in got.values())
        assert all(s["overlap"] and s["proposals"] > 0 for s in stats)
        settled += sum(s["spec_used"] + s["spec_dropped"] for s in stats)
    assert settled > 0, kind  # blocks really were drafted ahead and settled


class _SlowVerify:
    """A real target whose verify takes ``delay_s`` longer: the cost ratio of a big target to a small drafter (the
    tiny test target verifies faster than the drafter drafts, so nothing would be drafted before the verdict)."""

    def __init__(self, target, delay_s: float) -> None:
        self._target, self._delay = target, delay_s

    def __getattr__(self, name):
        return getattr(self._target, name)

    def verify(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._target.verify(*args, **kwargs)


def _noisy_ensemble(model_dir, scale: float = 0.05):
    """``_ensemble`` with a little noise on its LM's matrices (both members read it)."""
    drafter = _ensemble(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.massv.lm.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return drafter


@pytest.mark.parametrize("kind", ["text_lm", "ensemble"])
def test_predraft_foreseen_rejections_get_their_block_at_once_and_output_is_unchanged(lively, processor, kind):
    """SSD / Saguaro on the data plane: text_lm = the target's own LM with a little noise (the ensemble: its
    multimodal and text members over that LM, each rejection outcome ranked and each branch drawn from their
    mixture), so where it is wrong the target's token is often its runner-up; with predraft the drafter drafts
    blocks for those rejections while the (slowed) verifier works, some verdicts land on one (spec_branch), and
    greedy output equals plain decoding."""
    reqs = world_requests(processor, 3, SamplingParams(max_tokens=24))
    plain = SpecEngine(load_target(lively), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    drafter = _noisy_text_lm(lively) if kind == "text_lm" else _noisy_ensemble(lively)
    got = _serve_batch(_SlowVerify(load_target(lively), 0.08), drafter, reqs)
    assert {rid: g["tokens"] for rid, g in got.items()} == want
    stats = [g["dataplane"] for g in got.values()]
    assert sum(s["spec_branch"] for s in stats) > 0, stats
    assert all(s["spec_branch"] <= s["spec_used"] for s in stats)


class _SlowPrefill(_SlowVerify):
    """A real target whose prefill takes ``delay_s`` longer (a big target's prefill against a small drafter)."""

    def verify(self, *args, **kwargs):
        return self._target.verify(*args, **kwargs)

    def prefill(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._target.prefill(*args, **kwargs)


@pytest.mark.parametrize("overlap", [True, False])
def test_early_begin_drafts_the_first_block_during_the_prefill(lively, processor, overlap):
    """With a replica that offers early Begin, the verifier begins the session before its prefill: the drafter
    (the target's own LM on text prompts: its guess of the first token is right) has the first block ready when it
    is asked for; the output equals plain decoding. With overlap off nothing begins early."""
    reqs = world_requests(processor, 3, SamplingParams(max_tokens=12), suites=["text"])
    plain = SpecEngine(load_target(lively), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    got = _serve_batch(_SlowPrefill(load_target(lively), 0.1), _text_lm(lively), reqs, overlap=overlap)
    assert {rid: g["tokens"] for rid, g in got.items()} == want
    stats = [g["dataplane"] for g in got.values()]
    assert all(s["early"] == overlap for s in stats), stats
    if overlap:
        assert sum(s["first_ahead"] for s in stats) >= 2, stats  # the guess of the first token may miss
    else:
        assert not any(s["first_ahead"] for s in stats)


@pytest.mark.parametrize("kind", ["eagle", "eagle_tree"])
def test_repetitive_answers_use_blocks_drafted_ahead_and_rejections_drop_them(repetitive_model_dir, lively, processor,
                                                                             kind):
    req = world_requests(processor, 1, SamplingParams(max_tokens=30), start=2)[0]
    for d, want_used in ((repetitive_model_dir, True), (lively, False)):
        verifier = _verifier(d)
        try:
            with DrafterServer(DRAFTERS[kind](d), overlap=True) as server:
                s = verifier.generate(req, drafter_address=server.address)["dataplane"]
        finally:
            verifier.close()
        if want_used:  # one repeated token: every block accepted whole, its successor was drafted meanwhile
            assert s["spec_used"] > 0 and s["spec_used"] >= s["proposals"] - 2, s
            assert s["ahead_s"] > 0
        else:  # the pass-through head is wrong on a varied answer: blocks drafted ahead are dropped
            assert s["spec_dropped"] > 0 and s["spec_used"] < s["spec_dropped"], s


def test_overlap_off_is_sequential_and_gives_the_same_tokens(lively, processor):
    reqs = world_requests(processor, 2, SamplingParams(max_tokens=16), start=1)
    out = {}
    for overlap in (True, False):
        verifier = _verifier(lively, overlap=overlap)  # the session asks; the replica allows
        try:
            with DrafterServer(_text_lm(lively), overlap=True) as server:
                out[overlap] = {r.request_id: verifier.generate(r, drafter_address=server.address) for r in reqs}
        finally:
            verifier.close()
    assert {k: v["tokens"] for k, v in out[True].items()} == {k: v["tokens"] for k, v in out[False].items()}
    assert all(not g["dataplane"]["overlap"] and g["dataplane"]["spec_used"] + g["dataplane"]["spec_dropped"] == 0
               for g in out[False].values())


def test_seeded_sampling_is_identical_with_overlap_on_and_off_for_ngram(repetitive_model_dir, lively, processor):
    """ngram drafts a function of the committed tokens: same drafts, same verifier draws, same tokens."""
    for d in (repetitive_model_dir, lively):
        reqs = world_requests(processor, 3, SamplingParams(temperature=1.0, seed=11, max_tokens=24))
        single = SpecEngine(load_target(d), create({"kind": "ngram", "max_n": 3}), gamma=4)
        want = {r.request_id: single.generate([r])[r.request_id] for r in reqs}
        for overlap in (True, False):
            verifier = _verifier(d)
            try:
                with DrafterServer(create({"kind": "ngram", "max_n": 3}), overlap=overlap) as server:
                    got = {r.request_id: verifier.generate(r, drafter_address=server.address) for r in reqs}
            finally:
                verifier.close()
            for rid, g in got.items():
                assert g["tokens"] == want[rid].tokens, (d.name, overlap, rid)
                m = g["metrics"]
                assert (m["blocks"], m["draft_tokens"], m["accepted_tokens"]) == \
                       (want[rid].metrics.blocks, want[rid].metrics.draft_tokens, want[rid].metrics.accepted_tokens)


class _Recorder:
    """A RemoteDrafter seen by the engine: records each proposal with the committed tokens it was drafted after."""

    def __init__(self, remote: RemoteDrafter, engine_rows) -> None:
        self.remote, self.rows, self.log = remote, engine_rows, []

    @property
    def spec(self):
        return self.remote.spec

    def begin(self, contexts):
        self.remote.begin(contexts)

    def propose(self, ids, gamma):
        before = {r: self.remote.stats[r]["spec_used"] for r in ids}
        prop = self.remote.propose(ids, gamma)
        for b, r in enumerate(ids):
            n = prop.counts[b]
            spec = self.remote.stats[r]["spec_used"] > before[r]
            q = prop.q[b, :n].clone() if prop.q is not None else None
            self.log.append((r, list(self.rows[r].tokens), prop.tokens[b, :n].tolist(), q, spec))
        return prop

    def observe(self, verdicts):
        self.remote.observe(verdicts)

    def release(self, ids):
        self.remote.release(ids)


@pytest.mark.parametrize("offers", [False, True])
def test_sampled_blocks_drafted_ahead_carry_their_true_q(repetitive_model_dir, processor, offers):
    """Every block's q (pre-drafted or not, asked for or taken as an Offer) equals softmax(LM(committed context +
    earlier drafts) / T)."""
    T = 0.1  # peaked enough on the init-weight model that guesses hit, still a real sample
    drafter = _text_lm(repetitive_model_dir)
    image = drafter.image_token_id
    lm = drafter.model
    reqs = world_requests(processor, 2, SamplingParams(temperature=T, seed=5, max_tokens=24), start=1)
    target = _SlowVerify(load_target(repetitive_model_dir), 0.03 if offers else 0.0)  # slowed: offers come before the verdict
    remote = RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=30.0, offers=offers)
    engine = SpecEngine(target, None, gamma=4)
    rec = _Recorder(remote, engine.rows)
    engine.drafter = rec
    with DrafterServer(drafter, overlap=True) as server:
        for r in reqs:
            remote.attach(r.request_id, server.address)
            engine.generate([r])
    remote.close()
    prompts = {r.request_id: r.input_ids[r.input_ids != image].tolist() for r in reqs}
    assert any(spec for *_, spec in rec.log) and any(not spec for *_, spec in rec.log)
    taken = sum(remote.pop_stats(r.request_id)["offers_taken"] for r in reqs)
    assert (taken > 0) == offers, taken
    checked = 0
    with torch.no_grad():
        for rid, committed, tokens, q, spec in rec.log:
            if not tokens:
                continue
            assert q is not None and q.shape[0] == len(tokens)
            ctx = prompts[rid] + committed + tokens[:-1]
            logits = lm(torch.tensor([ctx])).logits[0, -len(tokens):].float()  # [N, V]
            logits[:, image] = float("-inf")
            want = torch.softmax(logits / T, dim=-1)
            torch.testing.assert_close(q, want, atol=2e-4, rtol=1e-3)
            checked += 1
    assert checked > 2


def test_pipeline_hit_sends_what_a_sequential_drafter_would_and_miss_rolls_back():
    """The Pipeline on ngram, message by message: a hit answers with the block drafted ahead (exactly the
    sequential block), a miss drops it and drafts from the corrected token."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    ahead, seq = create({"kind": "ngram"}), create({"kind": "ngram"})
    ahead.begin([DraftContext("a", torch.tensor(prompt), 7)])
    seq.begin([DraftContext("s", torch.tensor(prompt), 7)])
    p = Pipeline(ahead, "a", threading.Lock(), overlap=True)
    b = p.propose(3)
    assert b.tokens == [8, 9, 5] and not b.speculative
    p.speculate(lambda: False)  # guess 6, then drafts 7 8 9 + guess 5
    assert p.would_hit([0, 1, 2], 6) and not p.would_hit([0, 1], 9)
    p.verdict(Verdict("a", (0, 1, 2), (8, 9, 5), 6))
    b = p.propose(3)
    seq.observe([Verdict("s", (), (), 8)])  # the sequential drafter, brought to the same committed tokens
    seq.observe([Verdict("s", (), (), 9)])
    seq.observe([Verdict("s", (), (), 5)])
    seq.observe([Verdict("s", (), (), 6)])
    assert b.speculative and b.tokens == seq.propose(["s"], 3).tokens[0].tolist() == [7, 8, 9]
    assert p.used == 1
    p.speculate(lambda: False)
    p.verdict(Verdict("a", (0,), (7,), 1))  # a rejection at node 1: corrected token 1
    b = p.propose(3)
    assert not b.speculative and b.dropped == 1 and p.dropped == 1
    assert ahead._tokens["a"] == prompt + [7, 8, 9, 5, 6, 7, 1]  # rolled back to the committed tokens


def test_bench_distributed_quick_writes_valid_json(lively, tmp_path):
    from specula.cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "distributed", "--quick", "--model", str(lively), "--drafter", "ngram", "--suite", "vqa",
               "--suite", "text", "--n", "1",
               "--max-tokens", "12", "--gamma", "3", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "bench_distributed.json").read_text())
    assert set(r["configs"]) >= {"plain", "single_process", "sequential", "pipelined", "predraft", "offers"}
    for name in ("single_process", "sequential", "pipelined", "predraft", "offers"):
        assert r["configs"][name]["greedy_exact"] is True
        assert r["configs"][name]["speedup_vs_plain"] > 0
    assert r["configs"]["pipelined"]["spec_used"] + r["configs"]["pipelined"]["spec_dropped"] > 0
    assert 0 < r["overlap"]["efficiency"] and r["overlap"]["predraft_vs_pipelined"] > 0
    for name, c in r["configs"].items():  # the decode phase is what is left after each request's first token
        assert 0 < c["first_token_s"] < c["seconds"] and c["decode_s"] == pytest.approx(
            c["seconds"] - c["first_token_s"], abs=2e-4)
        assert c["decode_speedup_vs_plain"] > 0
    assert r["overlap"]["decode_pipelined_vs_sequential"] > 0 and r["overlap"]["decode_predraft_vs_pipelined"] > 0
    assert set(r["tokens_per_request"]) == {"vqa", "text"} and all(v >= 1 for v in r["tokens_per_request"].values())
    assert r["configs"]["predraft"]["spec_branch"] == 0  # ngram cannot rank rejections: nothing drafted for them
    assert r["configs"]["predraft"]["offers_taken"] == 0 and r["overlap"]["decode_offers_vs_sequential"] > 0
    assert r["configs"]["offers"]["offers_taken"] <= r["configs"]["offers"]["spec_used"]
    assert set(r["wire"]) >= {"fp32", "fp16", "int8"}
    for name in ("single_process", "sequential", "pipelined", "predraft", "offers"):  # drafter time per block / T_decode
        c = r["configs"][name]
        assert 0 < c["critical_draft_vs_t_decode"] < c["seconds"] / c["blocks"] / r["overlap"]["t_decode_s"]
        assert c["critical_draft_vs_t_decode"] == pytest.approx(  # the verifier's drafter time, not another phase
            c["critical_draft_s"] / c["blocks"] / r["overlap"]["t_decode_s"], rel=2e-3, abs=2e-3)
    md = (out / "bench_distributed.md").read_text()
    assert md.startswith("# ") and f"| {r['configs']['offers']['critical_draft_vs_t_decode']} | True |" in md


def test_bench_distributed_runs_the_verifier_on_one_thread_whoever_calls_it(lively):
    """The report calls ``bench distributed``'s ``run`` from a process at ``--threads 2``: the verifier must still run
    on one torch thread beside the drafter process's one (three threads on two cores slowed every overlapped
    config), and the caller's thread count comes back afterwards; each request's drafter Begin is booked apart."""
    from specula.runtime.bench import distributed

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = distributed.run(str(lively), {"kind": "ngram"}, 3, ("text",), 1, 8, log=lambda *_: None)
        assert r["machine"]["torch_threads"] == 1 and torch.get_num_threads() == 2
        assert all(c["draft_begin_s"] >= 0 for c in r["configs"].values())
        assert r["configs"]["single_process"]["draft_begin_s"] > 0
    finally:
        torch.set_num_threads(before)


def test_bench_distributed_pins_verifier_and_drafter_to_a_core_each(lively, tmp_path):
    """``--pin-cores`` (in its own process: the pinning must not leak into other tests): the verifier's and the
    drafter process's CPU affinity are one distinct core each, recorded in the JSON; output still equals plain."""
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores")
    out = tmp_path / "pinned"
    subprocess.run([sys.executable, "-m", "specula.cli", "bench", "distributed", "--model", str(lively), "--drafter",
                    "ngram", "--suite", "text", "--n", "1", "--max-tokens", "8", "--gamma", "3", "--pin-cores",
                    "--out", str(out)], check=True, timeout=300, capture_output=True)
    r = json.loads((out / "bench_distributed.json").read_text())
    cores = r["config"]["cores"]
    assert cores["pinned"] and len(cores["verifier"]) == 1 and len(cores["drafter"]) == 1
    assert cores["verifier"] != cores["drafter"]
    assert all(r["configs"][n]["greedy_exact"] for n in ("sequential", "pipelined", "predraft", "offers"))
    assert "pinned to core" in (out / "bench_distributed.md").read_text()


def _random_text_lm():
    """A maker of text_lm drafters over one random 2-layer LM (V = 64, token 63 = image) with peaked outputs."""
    torch.manual_seed(0)
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    lm = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    # fp32 weights: the tests below count what this model drafts (where its branches stop)
    return lambda: create({"kind": "text_lm", "model": lm, "image_token_id": 63, "quantize": "none"})


@pytest.mark.parametrize("lockstep", [True, False])
def test_pipeline_branch_hit_sends_what_a_sequential_drafter_would(lockstep):
    """The Pipeline on text_lm with predraft, message by message: branches open at the drafter's likeliest
    rejection outcomes (lockstep: all at once, grown beside the block past the guess; else one after another);
    a verdict with one of them gets that branch as its next block at once, exactly the block a sequential drafter
    proposes after the same committed tokens; an unforeseen verdict drops every branch."""
    make = _random_text_lm()
    ahead, seq = make(), make()
    prompt = torch.tensor([5, 9, 11, 2, 40, 7])
    ahead.begin([DraftContext("a", prompt, 3)])
    seq.begin([DraftContext("s", prompt, 3)])
    if not lockstep:
        ahead.grow = None  # a Predraft drafter without ``grow``: branches one after another
    p = Pipeline(ahead, "a", threading.Lock(), overlap=True, predraft=3)
    assert p.predraft == 3 and p.lockstep == lockstep
    b = p.propose(4)
    steps, mid = [], {}

    def stop() -> bool:  # at the third step, ask what a verdict arriving now would keep
        steps.append(1)
        if len(steps) == 3:
            mid.update({o: p.would_hit(list(range(o[0])), o[1]) for o in p._branches})  # noqa: SLF001
            mid["guess"] = p.would_hit(list(range(len(b.tokens))), p._guess)  # noqa: SLF001
            mid["other"] = p.would_hit([], next(x for x in range(63) if (0, x) not in p._branches  # noqa: SLF001
                                            and x != b.tokens[0]))
        return False

    p.speculate(stop)
    if lockstep:  # mid-way every chain is still growing: a verdict for any of them keeps drafting, others stop it
        assert mid.pop("other") is False and all(mid.values()) and len(mid) == 4
    # one step for the guess (drafted after the proposal is sent), then lockstep: gamma + 1 steps cover every chain
    assert len(steps) == 1 + (5 if lockstep else 5 + 3 * 6)
    assert len(p._branches) == 3 and all(len(n[0]) == 5 for n in p._branches.values())  # noqa: SLF001
    assert len(p._ahead) == 5  # noqa: SLF001
    (k, t), (nodes, _) = sorted(p._branches.items())[-1]  # noqa: SLF001
    assert t != b.tokens[k] if k < len(b.tokens) else t != p._guess  # noqa: SLF001
    assert p.would_hit(list(range(k)), t) is False  # nothing is growing now
    p.verdict(Verdict("a", tuple(range(k)), tuple(b.tokens[:k]), t))
    nb = p.propose(4)
    assert nb.speculative and nb.branch and p.branch_hits == 1 and nb.tokens == nodes[:4]
    for x in b.tokens[:k] + [t]:
        seq.observe([Verdict("s", (), (), x)])
    assert nb.tokens == seq.propose(["s"], 4).tokens[0].tolist()
    assert ahead.context("a") == seq.context("s")
    p.speculate(lambda: False)
    outcomes = set(p._branches) | {(4, p._guess)}  # noqa: SLF001
    miss = next((0, x) for x in range(63) if (0, x) not in outcomes and x != nb.tokens[0])
    p.verdict(Verdict("a", (), (), miss[1]))
    again = p.propose(4)
    assert not again.speculative and again.dropped == 1
    assert ahead.context("a")[-1] == miss[1]


def _prompt_rows(processor, n: int, text_only: bool) -> list:
    from specula.runtime.core.sampling import SamplingParams as _SP

    from specula.runtime.engine.prompts import EncodedPrompt

    reqs = [r for r in world_requests(processor, 4 * n, _SP(max_tokens=16)) if (r.pixel_values is None) == text_only]
    return [("s", r.request_id, EncodedPrompt(r.input_ids, r.pixel_values)) for r in reqs[:n]]


def test_outcome_ceiling_of_an_exact_drafter_is_its_guess(lively, processor):
    """The target's own LM on text prompts: every block is accepted whole and the bonus token is the guess."""
    from specula.runtime.bench.outcomes import measure

    r = measure(load_target(lively), _text_lm(lively), _prompt_rows(processor, 2, True), gamma=3, max_tokens=16, top=4)
    assert r["blocks"] >= 2 and r["coverage"]["1"] == 1.0 and r["not_ranked"] == 0.0


def test_outcome_ranks_find_rejections_among_the_drafters_runners_up(lively, processor):
    """A noisy copy of the target's LM on image prompts: where it is wrong the target's token is often its
    runner-up, so the top-m curve climbs past the guess; it never falls, and it ends at 1 - not_ranked."""
    from specula.runtime.bench.outcomes import measure

    drafter = _noisy_text_lm(lively)
    r = measure(load_target(lively), drafter, _prompt_rows(processor, 3, False), gamma=4, max_tokens=16, top=6)
    cov = [r["coverage"][str(m)] for m in range(1, 7)]
    assert cov == sorted(cov) and cov[-1] > cov[0]
    assert cov[-1] + r["not_ranked"] == pytest.approx(1.0, abs=1e-3)
    assert r["first_blocks"] <= 3 < r["blocks"]


def test_bench_outcomes_cli_writes_json_and_refuses_drafters_without_ranking(lively, tmp_path):
    from specula.cli import main

    out = tmp_path / "outcomes"
    rc = main(["bench", "outcomes", "--model", str(lively), "--suite", "text", "--n", "1", "--max-tokens", "8",
               "--top", "3", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "bench_outcomes.json").read_text())
    assert set(r["coverage"]) == {"1", "2", "3"} and r["config"]["drafter"] == {"kind": "text_lm"}
    assert (out / "bench_outcomes.md").read_text().startswith("# ")
    with pytest.raises(SystemExit, match="ranks rejection outcomes"):
        main(["bench", "outcomes", "--model", str(lively), "--drafter", "ngram", "--suite", "text", "--n", "1",
              "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_pipeline_offers_are_the_blocks_a_verdict_keeps_and_only_that_one_can_be_taken(temperature):
    """Offers, message by message: after drafting ahead, every chain (the block past the guess, each branch) is
    offered once with the verdict it is for; after that verdict the offered chain is the kept block (same tokens,
    same q), ``take`` of it sends nothing new and makes its node gamma the next guess, and taking any other offer,
    or any offer after an unforeseen verdict, is refused."""
    make = _random_text_lm()
    d = make()
    d.begin([DraftContext("a", torch.tensor([5, 9, 11, 2, 40, 7]), 3, temperature=temperature, seed=1)])
    p = Pipeline(d, "a", threading.Lock(), overlap=True, predraft=3, offers=True)
    b = p.propose(4)
    assert p.blocks == 1 and p.offers() == []  # nothing drafted ahead yet
    p.speculate(lambda: False)
    offers = p.offers()
    assert p.offers() == []  # each chain is offered once
    guess = [o for o in offers if not o.block.branch]
    branches = [o for o in offers if o.block.branch]
    assert len(guess) == 1 and len(branches) == 3 and len({o.id for o in offers}) == 4
    assert guess[0].accepted == (0, 1, 2, 3) and guess[0].next_token == p._guess  # noqa: SLF001
    assert all(o.after == 1 and len(o.block.tokens) == 5 and o.block.speculative for o in offers)
    assert {(len(o.accepted), o.next_token) for o in branches} == set(p._branches)  # noqa: SLF001
    assert all((o.block.q is None) == (temperature == 0) for o in offers)
    o = branches[-1]
    k = len(o.accepted)
    p.verdict(Verdict("a", o.accepted, tuple(b.tokens[:k]), o.next_token))
    with pytest.raises(ValueError, match="not the block the last verdict kept"):
        p.take(guess[0].id, 4)
    kept_q = p._ready.q  # noqa: SLF001
    nb = p.take(o.id, 4)
    assert nb.tokens == o.block.tokens[:4] and nb.branch and p.blocks == 2 and p.offers_taken == 1
    if temperature:
        torch.testing.assert_close(o.block.q, kept_q, rtol=0, atol=0)
    assert p._guess == o.block.tokens[4]  # noqa: SLF001
    p.speculate(lambda: False)
    later = p.offers()
    assert later and all(x.after == 2 for x in later)
    taken = {(x.accepted, x.next_token) for x in later}
    miss = next(t for t in range(63) if ((), t) not in taken and t != nb.tokens[0])
    p.verdict(Verdict("a", (), (), miss))
    with pytest.raises(ValueError):
        p.take(later[0].id, 4)
    again = p.propose(4)
    assert not again.speculative and again.dropped == 1 and p.blocks == 3


def test_offers_skip_the_round_trip_and_greedy_output_is_unchanged(lively, processor):
    """Offers over real gRPC: with a (slowed) verifier the drafter's blocks drafted ahead arrive before the verdict,
    the verifier takes the matching one without asking (offers_taken, no transfer counted for it), and greedy
    output equals plain decoding; with offers off nothing is taken and the output is the same."""
    reqs = world_requests(processor, 3, SamplingParams(max_tokens=24))
    plain = SpecEngine(load_target(lively), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    taken = {}
    for offers in (True, False):
        got = _serve_batch(_SlowVerify(load_target(lively), 0.06), _noisy_text_lm(lively), reqs, offers=offers)
        assert {rid: g["tokens"] for rid, g in got.items()} == want, offers
        stats = [g["dataplane"] for g in got.values()]
        assert all(s["offers_taken"] <= s["spec_used"] for s in stats)
        taken[offers] = sum(s["offers_taken"] for s in stats)
    assert taken[True] > 0 and taken[False] == 0, taken
