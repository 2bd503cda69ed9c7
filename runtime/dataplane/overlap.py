"""``Pipeline``: one session's drafting on the drafter side, with PEARL's post-verify overlap when it can.

Sequential (overlap off, or a drafter without ``Lookahead``)::

    ProposeRequest(gamma) -> propose(gamma) -> Proposal ... Verdict -> observe

With overlap (``drafters/protocol.py`` ``Lookahead``: ngram, text_lm, eagle, msd chains; eagle / msd trees)::

    ProposeRequest(gamma) -> propose(gamma): send d_1 .. d_gamma
    while the verifier verifies:  extend(1): g = the drafter's own next token (the guess, never sent), then
                                  extend(1) x (gamma + 1): x_1 .. x_gamma, g'   (as if d and g were committed)
    Verdict, ProposeRequest(gamma):
        all of d accepted and next_token == g  -> observe_ahead: send x_1 .. x_gamma at once (a hit), guess g'
        otherwise                             -> observe (drops every node past the accepted path), propose anew

Trees (eagle, msd). A tree is drafted ahead along its spine (``protocol.spine``: the first child at every level,
which for greedy rows is the drafter's greedy chain): the guess is the node after the spine's leaf, and a hit is a
verdict that accepts the whole spine with the guess as its next token. The block drafted ahead is a chain (sent
at once on a hit); after a miss the next proposal is a fresh tree.

The guess. The bonus token is the target's, unknown until the verdict; a drafter that needs the token before it
(every autoregressive one) cannot start block n+1 without a stand-in, so the guess is the drafter's own next
node: its argmax for greedy rows, a draw from its q for sampled ones (the same rule as every other node, so it
costs nothing to explain and keeps each node's q honest). A hit needs the target to agree with the guess.

Why a pre-drafted block is lossless: its tokens were drawn from q given d and g, with the drafter's own
randomness, after g was fixed. The verdict's agreement (all of d, next token g) depends on the target's draws and
on d and g only, so given a hit the block's tokens still have law q given the committed sequence, which is what
the verifier's rejection rule assumes; the q sent is the q each token was drawn from. Greedy rows are argmax
chains, so a hit sends exactly the block a sequential drafter would have drafted after the same verdict (ngram:
always the same; the neural drafters: up to floating-point differences in how their caches were filled).

Drafting ahead for rejections too (SSD / Saguaro; ``drafters/protocol.py`` ``Predraft``: text_lm, eagle and msd chains). Once the
block past the guess is drafted and the verdict is still out, the pipeline asks the drafter for its most likely
other outcomes, "d_0 .. d_{k-1} accepted, the target's token at k is t" (k = gamma: every node accepted, a bonus
token other than the guess), one at a time (at most ``predraft`` per block), and drafts gamma + 1 nodes after
each as a hidden branch. A verdict with that outcome makes the branch the next block, sent at once; a rejection
no longer has to wait for a fresh proposal when the drafter foresaw it. Each branch is lossless for the same
reason as the block past the guess: its tokens are drawn after (k, t) is fixed, from the drafter's randomness.

Lockstep (``drafters/protocol.py`` ``supports_lockstep``: text_lm, eagle and msd chains). A drafter that can feed several tips of
a row in one forward gets its branches opened first and grown beside the block past the guess, one node of each
per call: a 1-2 layer drafter step costs about the same for one tip as for three, so with the verdict ~gamma + 1
drafter steps away every outcome opened gets its block, instead of the first branch getting part of one.

The first block, during the target's prefill (``prime``; Begin.early). A drafter that needs nothing of the
target's prefill can start before it: it takes the prompt with its last token pending, so its next node is its
guess of the target's first token, and the pipeline drafts past that guess (and opens branches for the other
likely first tokens) exactly as past a block's guess. The first token then arrives as a verdict with nothing
accepted; a hit makes the first ProposeRequest's block ready at once, so neither the drafter's prompt prefill nor
its first block sits on the critical path. Lossless for the same reason: the first token is the target's draw.

Offers (``offers=True``; Begin.offers). Waiting for the ProposeRequest costs a round trip even when the block is
ready. With offers, the session sends each whole block it drafted ahead (the block past the guess, each branch) to
the verifier as soon as drafting ahead is done, with the verdict it is for (``offers``); a verifier whose verdict
matches one verifies that block at once and names it in its next ProposeRequest (``take``), so the drafter sends
nothing back for it. The offered block is the one ``verdict`` keeps for that verdict, so taking it is exactly a
hit answered without the round trip; lossless for the same reason as any block drafted ahead.

Speculation is cut short as soon as the next message makes it pointless (a Verdict that already disagrees, a
Release), one node at a time, so a miss costs at most one node's drafting on top of the sequential path.

Batched across sessions. In the DrafterServer every Pipeline drafts through the replica's ``DraftBatcher``
(``batcher.py``): its ``propose`` joins the other sessions' proposals with the same n in one drafter call, and its
drafting ahead is the same ``extend(1)`` per node, so sessions drafting ahead at the same moment share one
``extend`` call (a pass runs the critical-path proposals before the speculative extends). Drafting ahead stays
one node per call on purpose: the stop check between nodes is what keeps a miss cheap, and batching happens
across sessions rather than along one chain.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specula.drafters.protocol import Verdict, spine, supports_lockstep, supports_lookahead, supports_predraft


@dataclass
class Block:
    """What one Proposal carries (one row): tokens [N], tree parents [N] or None, q [N, V] fp32 or None."""

    tokens: list[int]
    parents: list[int] | None
    q: torch.Tensor | None
    speculative: bool = False  # pre-drafted (an overlap hit)
    branch: bool = False  # pre-drafted for a rejection outcome (a predraft hit)
    dropped: int = 0  # pre-drafted blocks dropped since the previous proposal
    draft_ns: int = 0  # drafting on the critical path
    ahead_ns: int = 0  # drafting ahead that led to this proposal (hit or dropped)


@dataclass(frozen=True)
class Offer:
    """A block drafted ahead, sent before it is asked for: the next block if the verdict of block ``after`` accepts
    exactly ``accepted`` and its next token is ``next_token`` (a chain of up to gamma + 1 nodes; a taker sends the
    first gamma, and node gamma is the drafter's next guess)."""

    id: int
    after: int  # proposals and taken offers before it (0: the early Begin's first token)
    accepted: tuple[int, ...]
    next_token: int
    block: Block


class Pipeline:
    """Drafting for one session key of a (shared) drafter.

    ``drafter`` is called with ``[key]`` only. The DrafterServer passes a ``batcher.DraftBatcher`` view (thread-safe:
    the calls of all sessions are batched on its worker, the drafting ahead's ``extend`` calls included) and no
    lock; a caller driving a plain drafter from several threads passes a ``lock`` that serializes its calls.
    """

    def __init__(self, drafter, key: str, lock: threading.Lock | None = None, overlap: bool = False,
                 predraft: int = 0, offers: bool = False) -> None:
        self.drafter, self.key = drafter, key
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.overlap = bool(overlap) and supports_lookahead(drafter)
        self.predraft = max(int(predraft), 0) if self.overlap and supports_predraft(drafter) else 0
        self.lockstep = bool(self.predraft) and supports_lockstep(drafter)  # branches grown side by side
        self.offering = bool(offers) and self.overlap  # whole blocks drafted ahead go out as Offers
        self.blocks = 0  # proposals sent and offers taken: the number of the block outstanding
        self._offer_ids = itertools.count(1)
        self._offered: dict[tuple[int, int] | None, int] = {}  # chain (None: past the guess) -> its Offer's id
        self._ready_offer: int | None = None  # the Offer the kept block was sent as (None: not offered)
        self._branches: dict[tuple[int, int], tuple[list[int], list[torch.Tensor | None]]] = {}  # (k, t) -> nodes
        self._growing: tuple[int, int] | None = None  # the branch being drafted (None: the block past the guess)
        self._live: set = set()  # lockstep: the chains still growing (None: the block past the guess; else (k, t))
        self._sent = 0  # nodes of the outstanding chain the verifier saw
        self._path: list[int] = []  # the nodes a verdict must accept for the guess to count (a tree: its spine)
        self._gamma = 0  # the gamma they answered
        self._guess: int | None = None  # the chain's node after them (overlap only)
        self._guess_due = False  # a fresh proposal was sent: its guess is drafted first thing while it is verified
        self._ahead: list[int] = []  # nodes drafted past the guess
        self._ahead_q: list[torch.Tensor | None] = []  # [V] each, None = deterministic
        self._ahead_ns = 0
        self._ready: Block | None = None  # a hit, waiting for its ProposeRequest
        self._since = (0, 0)  # (blocks dropped, ns drafted ahead) since the last Proposal
        self.used = self.dropped = 0  # speculative blocks sent / dropped over the session
        self.branch_hits = 0  # of the blocks sent, those drafted for a rejection outcome
        self.offers_taken = 0  # of the blocks sent, those the verifier took as Offers

    # ------------------------------------------------------------------------------------------- messages

    def propose(self, gamma: int) -> Block:
        t0 = time.perf_counter_ns()
        block = self._take_ready(gamma) if self._ready is not None else self._fresh(gamma)
        block.draft_ns = time.perf_counter_ns() - t0
        self.blocks += 1
        return block

    def take(self, offer_id: int, gamma: int) -> Block:
        """The verifier took Offer ``offer_id`` as its next block (its first ``gamma`` nodes): the same bookkeeping
        as ``propose`` answering with the kept block. ValueError unless it is the Offer the last verdict kept."""
        if self._ready is None or self._ready_offer is None or self._ready_offer != offer_id:
            raise ValueError(f"offer {offer_id} is not the block the last verdict kept "
                             f"(kept: {self._ready_offer if self._ready is not None else 'none'})")
        block = self._take_ready(gamma)
        self.blocks += 1
        self.offers_taken += 1
        return block

    def offers(self) -> list[Offer]:
        """The blocks drafted ahead after block ``blocks`` and not offered yet, each with the verdict it is for.
        Called once drafting ahead has ended with the verdict still out, so each chain is as long as it gets."""
        if not self.offering:
            return []
        chains = []
        if self._guess is not None and self._ahead:
            chains.append((None, tuple(self._path), self._guess, self._ahead, self._ahead_q))
        for (k, t), (tokens, qs) in self._branches.items():
            if tokens and not (t == self._guess and k == self._sent):  # verdict() keeps the guess's chain there
                chains.append(((k, t), tuple(range(k)), t, tokens, qs))
        dropped, before_ns = self._since
        out = []
        for key, accepted, nxt, tokens, qs in chains:
            if key in self._offered:
                continue
            self._offered[key] = oid = next(self._offer_ids)
            block = Block(list(tokens), None, _stack_q(tokens, qs), speculative=True, branch=key is not None,
                          dropped=dropped, ahead_ns=before_ns + self._ahead_ns)
            out.append(Offer(oid, self.blocks, accepted, int(nxt), block))
        return out

    def prime(self, gamma: int) -> None:
        """Early Begin: the drafter holds the prompt with its last token pending; draft one node (the guess of the
        target's first token, not sent) so that ``speculate`` drafts blocks of ``gamma`` past it, and branches for
        other first tokens, while the target prefills. The first token comes as a verdict with nothing accepted."""
        self._since = (0, 0)
        self._sent, self._path, self._gamma, self._guess = 0, [], max(int(gamma), 1), None
        if not self.overlap:
            return
        with self.lock:
            prop = self.drafter.propose([self.key], 1)
        if prop.counts[0]:
            self._guess = int(prop.tokens[0, 0])

    def verdict(self, v: Verdict) -> None:
        """Settle the blocks drafted ahead: a hit keeps its block for the next ProposeRequest, the rest are dropped."""
        accepted, nxt = [int(i) for i in v.accepted], int(v.next_token)
        ahead, ahead_q, ahead_ns = self._ahead, self._ahead_q, self._ahead_ns
        branch = self._branches.get((len(accepted), nxt)) if accepted == list(range(len(accepted))) else None
        is_branch = branch is not None and bool(branch[0]) and not (self._guess == nxt and len(accepted) == self._sent)
        if is_branch:
            ahead, ahead_q = branch
        hit = bool(ahead) and (is_branch or self._matches_guess(accepted, nxt))
        offered, self._offered, self._ready_offer = self._offered, {}, None
        self._ahead, self._ahead_q, self._ahead_ns, self._guess, self._ready = [], [], 0, None, None
        self._branches, self._growing, self._guess_due = {}, None, False
        dropped, before_ns = self._since
        if not hit:
            with self.lock:
                self.drafter.observe([v])  # drops every node past the accepted path: the rollback
            self.dropped += bool(ahead)
            self._since = (dropped + bool(ahead), before_ns + ahead_ns)
            return
        with self.lock:
            self.drafter.observe_ahead([v])  # the block drafted ahead is now the drafter's outstanding chain
        self._since = (0, 0)
        self._ready = Block(ahead, None, _stack_q(ahead, ahead_q), speculative=True, branch=is_branch,
                            dropped=dropped, ahead_ns=before_ns + ahead_ns)
        self._ready_offer = offered.get((len(accepted), nxt) if is_branch else None)

    def would_hit(self, accepted: list[int], next_token: int) -> bool:
        """Would a verdict with this path and next token keep the block being drafted ahead right now (the block
        past the guess, or the branch being drafted)? If not, drafting on is pointless."""
        if self.lockstep:  # the verdict's chain (the block past the guess, or a branch) still growing
            if self._matches_guess(accepted, next_token):
                return None in self._live
            return accepted == list(range(len(accepted))) and (len(accepted), next_token) in self._live
        if self._growing is None:
            return self._matches_guess(accepted, next_token)
        return accepted == list(range(self._growing[0])) and next_token == self._growing[1]

    def _matches_guess(self, accepted: list[int], next_token: int) -> bool:
        return self._guess is not None and accepted == self._path and next_token == self._guess

    # ------------------------------------------------------------------------------------------- drafting ahead

    @property
    def wants_ahead(self) -> bool:
        return self.overlap and (self._guess is not None or self._guess_due) and not self._ahead \
            and not self._branches

    def speculate(self, should_stop: Callable[[], bool]) -> None:
        """Draft up to gamma + 1 nodes past the guess (after the Proposal was sent), one at a time; then, while the
        verdict is still out, up to ``predraft`` branches of gamma + 1 nodes for the likeliest rejections. A fresh
        proposal's guess is drafted here first: off the critical path (a verdict that comes before it stops)."""
        if not self.wants_ahead:
            return
        t0 = time.perf_counter_ns()
        if self._guess_due:
            self._guess_due = False
            if should_stop():
                return
            with self.lock:  # a lockstep drafter grows (its only way of drafting ahead); others extend
                if self.lockstep:
                    guess = next((int(t) for o, t, _ in self.drafter.grow([self.key])[0] if o is None), None)
                else:
                    p = self.drafter.extend([self.key], 1)
                    guess = int(p.tokens[0, 0]) if p.counts[0] else None
            self._ahead_ns += time.perf_counter_ns() - t0
            if guess is None:
                return
            self._guess = guess
            t0 = time.perf_counter_ns()
        if self.lockstep:
            self._lockstep(should_stop)
            self._ahead_ns += time.perf_counter_ns() - t0
            return
        self._grow(self._ahead, self._ahead_q, should_stop)
        for _ in range(self.predraft):
            if should_stop():
                break
            with self.lock:
                opened = self.drafter.branch([(self.key, self._sent)])[0]
            if opened is None:
                break
            nodes: tuple[list[int], list[torch.Tensor | None]] = ([], [])
            self._growing = (int(opened[0]), int(opened[1]))
            self._branches[self._growing] = nodes
            self._grow(*nodes, should_stop)
        self._growing = None
        self._ahead_ns += time.perf_counter_ns() - t0

    def _grow(self, tokens: list[int], qs: list[torch.Tensor | None], should_stop: Callable[[], bool]) -> None:
        for _ in range(self._gamma + 1):
            if should_stop():
                break
            with self.lock:
                p = self.drafter.extend([self.key], 1)
            if not p.counts[0]:
                break
            tokens.append(int(p.tokens[0, 0]))
            qs.append(p.q[0, 0].float().cpu() if p.q is not None else None)

    def _lockstep(self, should_stop: Callable[[], bool]) -> None:
        """Open the ``predraft`` likeliest rejection outcomes first (nothing drafted), then grow the block past the
        guess and every branch together, one node each per ``grow`` call, gamma + 1 times at most. A drafter step
        costs about the same for one tip as for a few, so the branches ride along with the main block instead of
        queueing behind it, and a verdict that arrives early finds them all part-drafted."""
        with self.lock:
            opened = self.drafter.branch([(self.key, self._sent)] * self.predraft)
        for o in opened:
            if o is not None:
                self._branches[(int(o[0]), int(o[1]))] = ([], [])
        chains = {None: (self._ahead, self._ahead_q), **self._branches}
        self._live = set(chains)
        for _ in range(self._gamma + 1):
            if should_stop():
                break
            with self.lock:
                nodes = self.drafter.grow([self.key])[0]
            grew = set()
            for outcome, tok, q in nodes:
                key = None if outcome is None else (int(outcome[0]), int(outcome[1]))
                tokens, qs = chains[key]
                tokens.append(int(tok))
                qs.append(q.float().cpu() if q is not None else None)
                grew.add(key)
            # a chain that got no node has ended; one with gamma + 1 nodes is a whole block
            self._live = {k for k in grew if len(chains[k][0]) < self._gamma + 1}
            if not self._live:
                break
        self._live = set()

    # ------------------------------------------------------------------------------------------- internals

    def _take_ready(self, gamma: int) -> Block:
        """Send the kept block: its first gamma nodes; node gamma (if it is the chain's last) is the next guess."""
        b, self._ready = self._ready, None
        chain = b.tokens
        send = min(len(chain), max(gamma, 0))
        self._sent, self._path, self._gamma = send, list(range(send)), gamma
        self.used += 1
        self.branch_hits += b.branch
        # a longer chain (gamma shrank) is sent in part and not extended: observe drops its tail later
        self._guess = chain[gamma] if len(chain) == gamma + 1 and gamma > 0 else None
        q = b.q[:send] if b.q is not None and send else None
        return Block(chain[:send], None, q, speculative=True, branch=b.branch, dropped=b.dropped, ahead_ns=b.ahead_ns)

    def _fresh(self, gamma: int) -> Block:
        dropped, ahead_ns = self._since
        self._since = (0, 0)
        self._sent, self._path, self._gamma, self._guess, self._guess_due = 0, [], gamma, None, False
        if gamma <= 0:
            return Block([], None, None, dropped=dropped, ahead_ns=ahead_ns)
        with self.lock:
            prop = self.drafter.propose([self.key], gamma)
        c = int(prop.counts[0])
        tokens = prop.tokens[0, :c].tolist()
        parents = prop.parents[0, :c].tolist() if prop.parents is not None else None
        q = prop.q[0, :c].float() if prop.q is not None and c else None  # [N, V]
        # a full chain, or a tree (along its spine): speculate drafts the next node, the guess, first thing
        self._path = list(range(c)) if parents is None else spine(parents)
        self._guess_due = self.overlap and (c == gamma if parents is None else bool(self._path))
        self._sent = len(tokens)
        return Block(tokens, parents, q, dropped=dropped, ahead_ns=ahead_ns)


def _stack_q(tokens: list[int], qs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-node q rows (None = deterministic) -> [N, V] fp32, one-hot for deterministic rows; None if all are."""
    if not tokens or all(q is None for q in qs):
        return None
    V = next(q for q in qs if q is not None).shape[-1]
    out = torch.zeros(len(tokens), V)  # [N, V]
    for i, (t, q) in enumerate(zip(tokens, qs)):
        if q is None:
            out[i, t] = 1.0
        else:
            out[i] = q
    return out
