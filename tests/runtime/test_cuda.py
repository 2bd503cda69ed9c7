"""On a machine with a CUDA device (skipped elsewhere: CI has none): the target on the GPU, drafts made on the CPU
or on the GPU, and the output still that of plain decoding. The first run on an H100 found drafts from a CPU
drafter (ngram) rejected by ``verify_chain`` for being on another device than the target's probabilities."""

from __future__ import annotations

import pytest
import torch
from test_engine import _near_tie, kit, make_drafter, requests  # noqa: F401 (kit: the tiny model fixture)

from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.runtime.engine.prompts import encode_prompt
from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.core.tree_rejection import verify_tree
from specula.targets import load_target
from specula.world import generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_drafts_from_the_cpu_are_verified_where_the_target_is():
    p = torch.softmax(torch.randn(2, 4, 11, device="cuda") * 3, -1)  # [B, gamma + 1, V] on the GPU
    drafts = p[:, :3].argmax(-1).cpu()  # [B, gamma] from a CPU drafter
    v = verify_chain(drafts, None, p, greedy=True)
    assert v.accepted.tolist() == [3, 3] and v.next_token.device == p.device
    q = torch.softmax(torch.randn(2, 3, 11), -1)  # [B, gamma, V] on the CPU
    gens = [torch.Generator(device="cuda").manual_seed(b) for b in range(2)]
    v = verify_chain(drafts, q, p, generators=gens, greedy=False)
    assert 0 <= min(v.accepted.tolist()) <= max(v.accepted.tolist()) <= 3
    parents = torch.tensor([[-1, 0, 1], [-1, -1, 0]])  # [B, N] on the CPU
    t = verify_tree(parents, drafts, q, p, counts=[3, 3], generators=gens, greedy=False)
    assert len(t.paths()) == 2


@pytest.mark.parametrize("drafter_kind", ["ngram", "random", "random_tree"])
def test_greedy_on_the_gpu_equals_plain_decoding(kit, drafter_kind):
    model, processor = kit
    reqs = requests(kit, 16, SamplingParams(max_tokens=16))  # 2 prompts from each of the 8 evaluation suites
    eos = [processor.tokenizer.eos_token_id]
    target = load_target(model, device="cuda")
    ref = SpecEngine(target, None, eos_token_ids=eos).generate(reqs)
    info = target.info
    spec = SpecEngine(target, make_drafter(drafter_kind, info.vocab_size, info.image_token_id), gamma=4,
                      eos_token_ids=eos)
    got = {}
    for i in range(0, len(reqs), 4):
        got.update(spec.generate(reqs[i:i + 4]))
    differ = [r for r in reqs if got[r.request_id].tokens != ref[r.request_id].tokens]
    if differ:  # only an fp32 argmax tie may tell them apart (checked on the CPU copy of the model)
        model.to("cpu")
        try:
            assert all(_near_tie(model, processor, r, ref[r.request_id].tokens) for r in differ)
        finally:
            model.to("cuda")


def test_sampling_on_the_gpu_is_reproducible_per_seed(kit):
    model, processor = kit
    s = generate("vqa", "eval", 3)
    ids, pix = encode_prompt(processor, s.prompt, s.images)
    target = load_target(model, device="cuda")
    info = target.info
    spec = SpecEngine(target, make_drafter("random", info.vocab_size, info.image_token_id), gamma=4,
                      eos_token_ids=[processor.tokenizer.eos_token_id])
    runs = [spec.generate([GenerationRequest(f"s{k}", ids, pix, SamplingParams(temperature=1.0, seed=7,
                                                                               max_tokens=24))])
            for k in range(2)]
    assert runs[0]["s0"].tokens == runs[1]["s1"].tokens and len(runs[0]["s0"].tokens) > 0
