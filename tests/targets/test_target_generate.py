"""generate_plain, the no-speculation reference, is token-for-token HF ``generate`` (greedy)."""

from __future__ import annotations

import torch


def _hf_greedy(kit, req, max_new_tokens, eos=None):
    kw = {"pixel_values": req.pixel_values} if req.pixel_values is not None else {}
    if kit.name == "qwen2_5_vl":
        kit.model.model.rope_deltas = None
        kw["mm_token_type_ids"] = (req.input_ids == kit.model.config.image_token_id).int()[None]
        if req.image_grid_thw is not None:
            kw["image_grid_thw"] = req.image_grid_thw
    if eos is not None:
        kw["eos_token_id"] = eos
    ids = req.input_ids[None]
    out = kit.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kw
    )
    return out[0, ids.shape[1] :].tolist()


def test_generate_plain_equals_hf_generate_llava(llava_kit):
    reqs = [
        llava_kit.request("g0", [3, 4], [0], seed=61),
        llava_kit.request("g1", [7, 1, 2], [0, 0], seed=62),
        llava_kit.request("g2", [5], [], seed=63),
    ]
    mine = llava_kit.target().generate_plain(reqs, max_new_tokens=16)  # one batch, different lengths
    for req, got in zip(reqs, mine):
        assert got == _hf_greedy(llava_kit, req, 16)


def test_generate_plain_stops_at_eos(llava_kit):
    req = llava_kit.request("g0", [3, 4], [0], seed=61)
    full = _hf_greedy(llava_kit, req, 12)
    eos = full[5]
    target = llava_kit.target()
    got = target.generate_plain([req], max_new_tokens=12, eos_token_ids=[eos])[0]
    assert got == full[: full.index(eos) + 1]
    assert got == _hf_greedy(llava_kit, req, 12, eos=eos)
    assert target.live_ids == ()  # finished requests are released


def test_generate_plain_equals_hf_generate_qwen(qwen_kit):
    reqs = [qwen_kit.request("q0", [3, 4], [1], seed=64), qwen_kit.request("q1", [2, 6, 1], [0, 1], seed=65)]
    mine = qwen_kit.target().generate_plain(reqs, max_new_tokens=12)
    for req, got in zip(reqs, mine):
        assert got == _hf_greedy(qwen_kit, req, 12)


class _Watcher:
    """A drafter that needs both image feature variants, keeps its contexts and never drafts (plain steps)."""

    def __init__(self):
        from specula.drafters.protocol import DrafterSpec

        self.spec = DrafterSpec(kind="watcher", structure="chain", needs=frozenset({"visual", "pre_projector"}))
        self.contexts = []

    def begin(self, contexts):
        self.contexts += list(contexts)

    def propose(self, request_ids, gamma):
        from specula.drafters.protocol import Proposal

        return Proposal(tuple(request_ids), torch.zeros(len(request_ids), 1, dtype=torch.long),
                        (0,) * len(request_ids))

    def observe(self, verdicts):
        pass

    def release(self, ids):
        pass


def test_one_tower_pass_feeds_prefill_and_drafter_with_images_of_different_sizes(kit):
    """The engine's shared tower pass over a batch whose images differ in size (Qwen: 16x16 and 16x24 px) gives
    each request's drafter context its own images' features, padded only to its own longest image, and leaves the
    output as plain decoding's."""
    from specula.runtime.engine.loop import GenerationRequest, SpecEngine
    from specula.runtime.core.sampling import SamplingParams

    reqs = [kit.request("a", [3, 4], [0], seed=70), kit.request("b", [2, 5, 1], [1, 0], seed=71),
            kit.request("c", [4, 2], [1], seed=72)]
    gen = [GenerationRequest(r.request_id, r.input_ids, r.pixel_values, SamplingParams(max_tokens=6),
                             image_grid_thw=r.image_grid_thw) for r in reqs]
    plain = SpecEngine(kit.target(), None, eos_token_ids=[-1]).generate(gen)
    target, watcher = kit.target(), _Watcher()
    spec = SpecEngine(target, watcher, gamma=2, eos_token_ids=[-1]).generate(gen)
    assert {k: v.tokens for k, v in spec.items()} == {k: v.tokens for k, v in plain.items()}
    for c, r in zip(watcher.contexts, reqs):
        alone = target.encode_image_variants(r.pixel_values, ("projected", "pre_projector"),
                                             image_grid_thw=r.image_grid_thw)
        torch.testing.assert_close(c.visual, alone[0].features)
        torch.testing.assert_close(c.extra["pre_projector"], alone[1].features)
