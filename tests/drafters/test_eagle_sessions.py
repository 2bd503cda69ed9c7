"""eagle (and msd, which shares its drafting and cache) as a DrafterServer with overlap drives it: one call per
session, each session drafting ahead (``extend`` / ``observe_ahead``) while the others' proposals are outstanding.

Compaction used to wait for a moment with no proposal outstanding; with sessions drafting ahead that moment never
comes and the cache grew without bound. Now it compacts anyway, pinning the outstanding chains' fed columns (invalid
slots fed with predicted h^ that ``extend`` still attends to) and renumbering them. Checked here: the cache stays
bounded; every proposal and extension equals that of a drafter that never compacts; a fresh chain's q equals a
from-scratch recompute; and through a real DrafterServer (overlap on) with concurrent requests and a tight
compaction policy, greedy output equals plain decoding.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from drafter_kit import as_msd, eos, lively_target, plain, random_head, ref_head_outputs, requests

from specula.drafters import DraftContext, Verdict
from specula.drafters.eagle import EagleDrafter
from specula.drafters.msd import MsdDrafter
from specula.drafters.protocol import supports_lookahead
from specula.runtime.dataplane import DrafterServer, RemoteDrafter
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.verifier import VerifierEngine
from specula.targets import load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

TIGHT = KVPolicy(min_waste=4, waste_ratio=0.0)  # compact as soon as 4 columns are reclaimable
NEVER = KVPolicy(min_waste=10**9)
GAMMA = 3


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx = lively_target(processor)
    eagle = random_head(ctx)
    return {"processor": processor, "ctx": ctx, "eagle": eagle, "msd": as_msd(eagle)}


def _drafter(kit, kind: str, policy: KVPolicy, target=None) -> EagleDrafter:
    cls = EagleDrafter if kind == "eagle" else MsdDrafter
    return cls(head=kit[kind], structure="chain", target=target or load_target(kit["ctx"]), kv_policy=policy,
               quantize="none")


class _Sessions:
    """Drives a compacting drafter and a never-compacting twin with the same calls and checks they propose alike;
    keeps each session's committed pairs for the recompute."""

    def __init__(self, d: EagleDrafter, ref: EagleDrafter, n: int, seed: int = 0):
        self.d, self.ref, self.rng = d, ref, random.Random(seed)
        self.g = torch.Generator().manual_seed(seed + 1)
        self.H, self.image = d.head.config.hidden_size, d.image_token_id
        self.temps = {f"s{i}": (0.0, 1.0)[i % 2] for i in range(n)}
        self.committed: dict[str, tuple[torch.Tensor, list[int]]] = {}  # (h [m, H], next tokens [m])
        self.fresh: dict[str, bool] = {}  # the outstanding chain has seen no verdict: the recompute applies
        contexts = []
        for i, rid in enumerate(self.temps):
            prompt = [self._token() for _ in range(4 + 3 * i)]
            first, h = self._token(), torch.randn(len(prompt), self.H, generator=self.g)
            contexts.append(DraftContext(rid, torch.tensor(prompt), first, self.temps[rid], seed=i, hidden=h))
            self.committed[rid] = (h, prompt[1:] + [first])
        d.begin(contexts)
        ref.begin(contexts)
        self.checked = 0

    def _token(self) -> int:
        while (t := self.rng.randrange(self.d.vocab_size)) == self.image:
            pass
        return t

    def chain(self, rid: str) -> list[int]:
        return list(self.d._rows[rid].draft[0]) if self.d._rows[rid].draft else []  # noqa: SLF001

    def call(self, method: str, *args):
        got, want = getattr(self.d, method)(*args), getattr(self.ref, method)(*args)
        if method in ("propose", "extend"):
            assert got.counts == want.counts and torch.equal(got.tokens, want.tokens), method
            assert (got.q is None) == (want.q is None)
            if got.q is not None:
                torch.testing.assert_close(got.q, want.q, atol=1e-5, rtol=0)
        return got

    @torch.no_grad()
    def draft(self, rid: str, fresh: bool) -> None:
        """A fresh chain of gamma + 1 (sent + the guess), or the kept one, then gamma + 1 extensions of one node."""
        qs: list[torch.Tensor | None] = []  # the q sent with each node (None: greedy)
        if fresh:
            p = self.call("propose", [rid], GAMMA + 1)
            qs = [None if p.q is None else p.q[0, j] for j in range(p.counts[0])]
            self.fresh[rid] = True
        for _ in range(GAMMA + 1):
            p = self.call("extend", [rid], 1)
            if not p.counts[0]:
                break
            qs.append(None if p.q is None else p.q[0, 0])
        if self.fresh[rid]:  # every node of the chain, proposed or extended: q = a recompute over committed pairs
            h, nxt = self.committed[rid]
            toks, t = self.chain(rid), self.temps[rid]
            out = ref_head_outputs(self.d.head, h, nxt, toks)
            qs = [None] * (len(toks) - len(qs)) + qs  # a kept chain's earlier nodes were checked when drawn
            for j, (tok, q) in enumerate(zip(toks, qs)):
                logits = self.d.head.logits(out[j])
                logits[self.image] = float("-inf")
                if t == 0:
                    assert tok == int(logits.argmax())
                elif q is not None:
                    torch.testing.assert_close(q, torch.softmax(logits / t, -1), atol=1e-4, rtol=0)
                self.checked += 1

    def verdict(self, rid: str, hit: bool) -> bool:
        """Accept the gamma sent nodes and the guess (a hit: the extension stays outstanding; True), or miss at k."""
        chain = self.chain(rid)
        if hit and len(chain) > GAMMA + 1:
            k, nxt, method = GAMMA, chain[GAMMA], "observe_ahead"
        else:
            k = self.rng.randrange(0, min(GAMMA, len(chain)) + 1)
            nxt = self._token()
            while k < len(chain) and nxt == chain[k]:
                nxt = self._token()
            method = "observe"
        hidden = torch.randn(1 + k, self.H, generator=self.g)
        self.call(method, [Verdict(rid, tuple(range(k)), tuple(chain[:k]), nxt, hidden=hidden)])
        h, x = self.committed[rid]
        self.committed[rid] = (torch.cat([h, hidden]), x + chain[:k] + [nxt])
        self.fresh[rid] = False
        return method == "observe_ahead"


@pytest.mark.parametrize("kind", ["eagle", "msd"])
def test_sessions_drafting_ahead_keep_the_cache_bounded_and_drafts_unchanged(kit, kind):
    d, ref = _drafter(kit, kind, TIGHT), _drafter(kit, kind, NEVER)
    s = _Sessions(d, ref, 4)
    rows = list(s.temps)
    for rid in rows:
        s.draft(rid, fresh=True)
    longest, shrank, verdicts, outstanding = 0, 0, 0, 0
    for step in range(40):  # round robin: each session's verdict arrives while every other one has a draft out
        rid = rows[step % len(rows)]
        before = d._kv.seq_len  # noqa: SLF001
        kept = s.verdict(rid, hit=s.rng.random() < 0.5)
        verdicts += 1
        outstanding += any(r.draft is not None for r in d._rows.values())  # noqa: SLF001 - the old rule's blocker
        shrank += d._kv.seq_len < before  # noqa: SLF001
        longest = max(longest, d._kv.seq_len)  # noqa: SLF001
        for b, r in enumerate(d._rows.values()):  # noqa: SLF001 - pinned columns survived, still invalid
            if r.ahead is not None:
                assert all(0 <= c < d._kv.seq_len and not bool(d._kv.valid[b, c]) for c in r.ahead.cols)  # noqa: SLF001
        s.draft(rid, fresh=not kept)
    assert outstanding == verdicts  # compaction waiting for no outstanding draft would never have run
    assert shrank > 5 and s.checked > 50
    most = max(len(x) for _, x in s.committed.values())  # committed pairs of the longest session
    # bounded by the committed length plus one round's drafting: pinned chains (<= 2 gamma + 2 per row) and the
    # columns one session's calls add (tail, gamma + 1 levels, gamma + 1 extensions) before the next reclaim
    assert longest <= most + 2 * (2 * GAMMA + 2) + 4 * GAMMA + 8, (longest, most)
    assert ref._kv.seq_len > 2 * longest  # noqa: SLF001 - the same calls without compaction: unbounded growth
    d.release(rows)
    ref.release(rows)
    assert d._kv.cache is None and not d._rows  # noqa: SLF001


def _generate_all(verifier, reqs, address) -> dict:
    got = {}

    def one(r):
        got[r.request_id] = verifier.generate(r, drafter_address=address)

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return got


@pytest.mark.parametrize("kind,predraft", [("eagle", 0), ("msd", 0), ("msd", 3)])
def test_greedy_with_overlap_and_tight_compaction_equals_plain_decoding(kit, kind, predraft):
    reqs = requests(kit, 6, SamplingParams(max_tokens=24))
    want = plain(kit, "ctx", reqs, 6)
    d = _drafter(kit, kind, TIGHT)
    assert supports_lookahead(d)
    seen = {"compactions": 0, "with_outstanding": 0}
    reclaim = d._reclaim  # noqa: SLF001

    def counted():
        before = d._kv.seq_len  # noqa: SLF001
        busy = any(r.draft is not None for r in d._rows.values())  # noqa: SLF001
        reclaim()
        if d._kv.seq_len < before:  # noqa: SLF001
            seen["compactions"] += 1
            seen["with_outstanding"] += busy

    d._reclaim = counted  # noqa: SLF001
    target = load_target(kit["ctx"])
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=60.0),
                              gamma=GAMMA, eos_token_ids=eos(kit))
    try:
        with DrafterServer(d, overlap=True, predraft=predraft) as server:
            got = _generate_all(verifier, reqs, server.address)
    finally:
        verifier.close()
    assert {rid: g["tokens"] for rid, g in got.items()} == {r.request_id: want[r.request_id].tokens for r in reqs}
    assert all(g["drafter"] == "ok" and g["dataplane"]["overlap"] for g in got.values())
    assert seen["with_outstanding"] > 0, seen
