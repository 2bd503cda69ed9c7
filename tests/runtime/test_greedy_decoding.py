"""At temperature 0, speculative decoding (chain or tree) emits exactly the tokens of argmax decoding."""

from __future__ import annotations

import torch

from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import SamplingParams, logits_to_probs
from specula.runtime.core.tree_rejection import verify_tree

V = 12
GREEDY = SamplingParams()


class ToyLM:
    """Next-token logits from the last two tokens; the drafter is a noisy copy of the target."""

    def __init__(self, seed: int, noise: float = 0.0, base: "ToyLM | None" = None):
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(V, V, V, generator=gen)
        self.table = table if base is None else base.table + noise * table  # [V, V, V]

    def logits(self, ctx: list[int]) -> torch.Tensor:
        return self.table[ctx[-2], ctx[-1]]  # [V]


def argmax_decode(target: ToyLM, prompt: list[int], length: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(length):
        ctx.append(int(logits_to_probs(target.logits(ctx), GREEDY).argmax()))
    return ctx[len(prompt) :]


def test_greedy_chain_verification_equals_argmax_decoding_step_by_step():
    target = ToyLM(0)
    drafter = ToyLM(1, noise=0.8, base=target)
    prompts = [[1, 2], [3, 3], [0, 11], [7, 5]]
    length, gamma = 30, 4
    outs = [[] for _ in prompts]
    ctxs = [list(pr) for pr in prompts]
    steps = 0
    while min(len(o) for o in outs) < length:
        steps += 1
        counts = [(steps + b) % (gamma + 1) for b in range(len(prompts))]  # rows draft different amounts
        drafts = torch.full((len(prompts), gamma), -1)
        p = torch.zeros(len(prompts), gamma + 1, V)
        for b, ctx in enumerate(ctxs):
            c = list(ctx)
            for j in range(counts[b]):
                c.append(int(drafter.logits(c).argmax()))
                drafts[b, j] = c[-1]
            for j in range(counts[b] + 1):  # the target's p after the prefix plus j drafts
                p[b, j] = logits_to_probs(target.logits(c[: len(ctx) + j]), GREEDY)
        v = verify_chain(drafts, None, p, num_draft=counts, greedy=True)
        for b, row in enumerate(v.output_tokens.tolist()):
            new = [t for t in row if t >= 0]
            assert len(new) == v.accepted[b] + 1
            outs[b] += new
            ctxs[b] += new
    for prompt, out in zip(prompts, outs):
        assert out[:length] == argmax_decode(target, prompt, length)
    assert steps < len(prompts) * length  # drafts were accepted along the way


def test_greedy_tree_verification_equals_argmax_decoding_step_by_step():
    target = ToyLM(2)
    drafter = ToyLM(3, noise=1.0, base=target)
    prompt, length = [4, 9], 40
    # Binary tree of depth 3: each node's two children are the drafter's top-2 after that node's path.
    parents = [-1, -1] + [i for i in range(6) for _ in range(2)]  # 14 nodes
    out, ctx, blocks, accepted = [], list(prompt), 0, 0
    while len(out) < length:
        blocks += 1
        paths: list[list[int]] = []
        tokens = []
        for i, par in enumerate(parents):
            base = ctx if par < 0 else ctx + paths[par]
            order = drafter.logits(base).topk(2).indices.tolist()
            tok = order[0] if (par < 0 and i == 0) or (par >= 0 and i % 2 == 0) else order[1]
            tokens.append(tok)
            paths.append((paths[par] if par >= 0 else []) + [tok])
        p = torch.stack([logits_to_probs(target.logits(ctx), GREEDY)]
                        + [logits_to_probs(target.logits(ctx + path), GREEDY) for path in paths])[None]
        v = verify_tree(torch.tensor([parents]), torch.tensor([tokens]), None, p, greedy=True)
        new = [t for t in v.output_tokens[0].tolist() if t >= 0]
        accepted += int(v.accepted)
        out += new
        ctx += new
    assert out[:length] == argmax_decode(target, prompt, length)
    assert accepted > 0
