"""aasd as a DrafterServer drives it with concurrent sessions: one call per session, so a verdict arrives while the
other sessions' proposals are outstanding. Compaction used to wait for a moment with none outstanding (which may
never come) and the cache grew without bound; a draft's columns are dead once its chain is drawn, so it now
compacts anyway. Checked: the cache stays bounded and every proposal equals a never-compacting twin's.
"""

from __future__ import annotations

import random

import torch
from drafter_kit import lively_target

from specula.drafters import DraftContext, Verdict
from specula.drafters.aasd import AasdDrafter
from specula.drafters.aasd_head import AasdConfig, AasdHead
from specula.targets import load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

GAMMA = 3


def _head(model) -> AasdHead:
    head = AasdHead(AasdConfig.from_target(model, kv_tokens=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=g)
    head.attach(model.get_input_embeddings(), model.get_output_embeddings())
    return head.eval()


def test_sessions_with_proposals_outstanding_keep_the_cache_bounded_and_drafts_unchanged():
    model = lively_target(load_processor(TOKENIZER_DIR))
    head, target = _head(model), load_target(model)
    d = AasdDrafter(head=head, target=target, kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0))
    ref = AasdDrafter(head=head, target=target, kv_policy=KVPolicy(min_waste=10**9))
    cfg, rng, g = head.config, random.Random(0), torch.Generator().manual_seed(2)

    def token() -> int:
        while (t := rng.randrange(d.vocab_size)) == d.image_token_id:
            pass
        return t

    def kv(n: int) -> dict:
        shape = (cfg.num_key_value_heads, n, cfg.head_dim)
        return {"last_k": torch.randn(shape, generator=g), "last_v": torch.randn(shape, generator=g)}

    rows = [f"s{i}" for i in range(4)]
    contexts = [DraftContext(rid, torch.tensor([token() for _ in range(4 + 3 * i)]), token(), (0.0, 1.0)[i % 2],
                             seed=i, extra=kv(4 + 3 * i)) for i, rid in enumerate(rows)]
    d.begin(contexts)
    ref.begin(contexts)
    committed = {c.request_id: len(c.prompt_ids) for c in contexts}

    def propose(rid: str) -> list[int]:
        got, want = d.propose([rid], GAMMA), ref.propose([rid], GAMMA)
        assert torch.equal(got.tokens, want.tokens) and (got.q is None) == (want.q is None)
        if got.q is not None:
            torch.testing.assert_close(got.q, want.q, atol=1e-5, rtol=0)
        return got.tokens[0].tolist()

    chains = {rid: propose(rid) for rid in rows}
    longest, shrank = 0, 0
    for step in range(40):  # round robin: each verdict arrives while every other session has a proposal out
        rid = rows[step % len(rows)]
        chain, k = chains[rid], rng.randrange(0, GAMMA + 1)
        before = d._kv.seq_len  # noqa: SLF001
        v = Verdict(rid, tuple(range(k)), tuple(chain[:k]), token(), extra=kv(1 + k))
        d.observe([v])
        ref.observe([v])
        committed[rid] += 1 + k
        assert sum(r.draft is not None for r in d._rows.values()) == len(rows) - 1  # noqa: SLF001
        shrank += d._kv.seq_len < before  # noqa: SLF001
        longest = max(longest, d._kv.seq_len)  # noqa: SLF001
        chains[rid] = propose(rid)
    assert shrank > 5
    # the committed context plus what one session's calls add before the next reclaim (its verdict, gamma columns)
    assert longest <= max(committed.values()) + 2 * GAMMA + 8, (longest, committed)
    assert ref._kv.seq_len > 2 * longest  # noqa: SLF001 - the same calls without compaction
    d.release(rows)
    assert d._kv.cache is None and not d._rows  # noqa: SLF001
