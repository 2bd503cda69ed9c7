"""``text_lm``: a small LM over the target's tokenizer drafts from the prompt with the images removed.

The text-only drafter of IbED / MASSV and the model HF assisted generation uses (the draft-model method): any
``AutoModelForCausalLM`` checkpoint (Llama, Qwen2, Mistral, ...; the shipped one is a stock ``LlamaForCausalLM``,
``training/drafters/text_lm_config.py``, distilled from the target by ``training/drafters/text_lm.py``) that sees
the request's prompt with every image token dropped, then the committed tokens. Its tokenizer must be the target's
or a prefix of it (``drafters/vocab.py``): it drafts only ids both have, its q is 0 on the others (padded to the
target's vocabulary, or cut to it and renormalised), and a target id it lacks is fed to it as its unk token.

Drafting. ``structure="chain"``: ``gamma`` tokens, each drawn from q = softmax(logits / T) given the ones before
(T = the request's temperature; T = 0 takes the argmax and q is one-hot). ``structure="tree"``: ``branching``
children per node for ``depth`` levels (an int, or one width per level, e.g. ``(3, 2, 1)``), at most ``gamma``
levels; the children of a node are drawn from its q *without replacement, kept in draw order* (greedy rows: the
top-b tokens), which is the law ``verify_tree(siblings="without_replacement")`` assumes; a sibling that finds no
mass left (fewer than b tokens with q > 0) is dropped with its subtree. ``Proposal.q[b, i]`` is the q of node i's
parent path: exactly the distribution node i was drawn from (one-hot for greedy rows; ``q=None`` when every row
is greedy). The image token is never proposed (its q is 0). Randomness comes from one generator per request,
seeded from the drafter's ``seed`` and the request's seed, so a seeded request drafts the same whatever shares its
batch.

KV cache (one ``targets.kv.BatchedKV`` over all live rows, keys stored post-RoPE so slot order is free). Per row:

    context  text-only prompt + committed tokens       tail  committed tokens not in the cache yet (the last ones)
    next_pos position of tail[0]                       draft the unobserved proposal: node tokens, parents, columns

- ``begin`` prefills the text-only prompt; tail = [first_token].
- ``propose``: one forward feeds every row's tail (width = longest tail; the root q comes from its last token), then
  one forward per tree level feeds that level's nodes (chain: one token). Every forward appends its columns to all
  rows; a node attends to the row's valid committed slots, its ancestors' columns and itself. The last level is
  never fed. Cost: ``depth`` forwards per block (chain: gamma), the first of width max(tail). Chains keep the
  levels' bookkeeping on the host (``_draw_chain``: one node per row, no tree masks); trees go through
  ``_draw_levels``, which draws any shape, chains included, the same way (a test compares the two).
- ``observe``: the accepted path's fed nodes stay valid (their K/V were computed at their final positions); every
  other column of the proposal is marked invalid; the unfed rest of the path (the last-level node when a whole
  branch is accepted) and the next token become the new tail. So after ``observe`` the cache holds exactly the
  committed sequence minus the tail, which the next ``propose`` feeds first.
- Holes left by rejected drafts cost attention work only; ``BatchedKV.reclaim`` compacts them (``_reclaim``:
  it moves columns, so outstanding proposals' fed columns are renumbered; waiting for a moment with no proposal
  outstanding never comes when sessions draft ahead, and the cache then grows without bound).
- Lookahead (chains only, ``drafters/protocol.py``): ``extend`` feeds the chain's last (unfed) node at its
  position, draws the next node from the logits, and so on; a row's fed draft columns are valid in its own row and
  all of them are ancestors of a chain's new node, so its mask is simply the row's valid slots. ``observe_ahead``
  keeps the accepted nodes' and the guessed node's columns (already computed at their final positions), so the
  rest of the chain stays a proposal with an empty tail.

    drafter = create({"kind": "text_lm", "path": "text_lm", "structure": "tree", "branching": [3, 2, 1]},
                     target=target)
    engine = SpecEngine(target, drafter, gamma=4)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from specula.drafters import int8_weights, lean_llama, stopping
from specula.drafters.outcomes import best_outcome, node_rank
from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registration import register
from specula.drafters.seeding import request_generator
from specula.drafters.vocab import VocabMap, as_tokenizer, check_vocab
from specula.runtime.core.sampling import sample_without_replacement  # pure torch, no Ray/gRPC
from specula.targets.kv import BatchedKV, GrowableLayer, KVPolicy, attention_mask, growable_cache


@dataclass
class _Draft:
    """A row's unobserved proposal, after compaction (node i of the Proposal row).

    Chains drafting ahead (lookahead / predraft) also keep: ``main`` nodes 0 .. main-1 form the chain the verifier
    sees (plus what was drafted past it); nodes after them are hidden branches (``branch``), each a chain whose
    first node's parent is a main node (or -1); ``tip`` is the node ``extend`` grows; ``logits`` keeps, per node,
    the row it was drawn from, so ``branch`` can rank the rejection outcomes (a node's own probability, its best
    ``outcomes.ALTS`` other tokens with theirs) lazily, only when a pipeline asks for them."""

    tokens: list[int]
    parents: list[int]  # -1 = off the committed context
    cols: list[int]  # cache column of node i, -1 = not fed (last level)
    closed: bool = False  # the tip found no successor (no mass left): extend adds nothing
    main: int = 0  # chains: nodes 0 .. main-1 are the main chain
    tip: int = -1  # chains: the node extend grows (-1: the last main node)
    # per node [V] fp32, None = a branch's first; chains always, trees if the drafter ``keep_tree_logits``
    logits: list[torch.Tensor | None] = field(default_factory=list)
    ranked: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)  # node -> (own, alts)
    opened: set[tuple[int, int]] = field(default_factory=set)  # branch outcomes (k, t) opened so far
    lanes: list[int] | None = None  # chains: the tips ``grow`` feeds (the main chain's, each open branch's)


@dataclass
class _Row:
    context: list[int]  # text-only prompt + committed tokens
    tail: list[int]  # the last committed tokens, not yet in the cache
    next_pos: int  # position id of tail[0]
    temperature: float
    generator: torch.Generator
    draft: _Draft | None = None


@dataclass(frozen=True)
class _Tree:
    """Static tree of one proposal: BFS order, a node's children contiguous and in draw order."""

    widths: tuple[int, ...]  # children per node at each level
    parents: tuple[int, ...]  # [N]
    offsets: tuple[int, ...]  # first node of each level; nodes before offsets[-1] are fed
    ancestors: torch.Tensor = field(repr=False)  # [N, N] bool, strict ancestors

    @classmethod
    def build(cls, widths: Sequence[int]) -> _Tree:
        """The tree of these widths, built once per shape (proposals repeat a few shapes; nothing mutates one)."""
        return _tree(tuple(widths))

    @classmethod
    def _make(cls, widths: tuple[int, ...]) -> _Tree:
        parents, offsets, level = [], [], [-1]
        for k in widths:
            offsets.append(len(parents))
            nxt = []
            for p in level:
                for _ in range(k):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            level = nxt
        anc = torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for i, p in enumerate(parents):  # parents precede children
            if p >= 0:
                anc[i] = anc[p]
                anc[i, p] = True
        return cls(tuple(widths), tuple(parents), tuple(offsets), anc)


@lru_cache(maxsize=256)
def _tree(widths: tuple[int, ...]) -> _Tree:
    return _Tree._make(widths)


@register("text_lm")
class TextLMDrafter:
    """Options: ``path`` (zoo name or directory of an ``AutoModelForCausalLM`` checkpoint, with its tokenizer,
    default "text_lm") or ``model`` (an instance, then of the target's vocabulary size); ``structure`` "chain" |
    "tree"; for trees ``branching`` children per node for ``depth`` levels, or
    a list of widths per level (then ``depth`` is unused);
    ``seed``; ``image_token_id`` (default: the target's, else the model dir's specula.json); ``kv_policy``;
    ``device`` / ``dtype``; ``lean`` (default true: draft steps run ``drafters/lean_llama.py``, the same math as
    the stock forward without its per-call overhead; false forces the stock forward, e.g. to measure the gain);
    ``quantize`` "auto" (default: int8 weights on a CPU), "int8" or "none": lean draft steps over int8 copies of
    the decoder layers' and the head's weights (``drafters/int8_weights.py``; changes what is drafted, never the
    output);
    ``stop_token_ids`` (default: the target's EOS ids, else the model's ``eos_token_id``; ``[]`` = never stop):
    a drafted stop token ends its branch, since a generation that accepts it is over and anything drafted after
    it could never be used (short answers then cost two or three draft steps instead of gamma).
    ``vocab_size``: the target's vocabulary, the width of q (default the target's; needed without one).
    Resources: ``target`` (its vocabulary and image token), ``tokenizer`` (the target's: checked against the
    drafter's own, ``drafters/vocab.py``; a tokenizer, a processor or a directory)."""

    def __init__(self, path: str | Path = "text_lm", model: nn.Module | None = None, structure: str = "chain",
                 branching: int | Sequence[int] = 2, depth: int = 3, seed: int = 0,
                 image_token_id: int | None = None, kv_policy: KVPolicy | None = None, device: str | None = None,
                 dtype: str | None = None, attn_implementation: str = "sdpa", lean: bool = True,
                 quantize: str = "auto", stop_token_ids: Sequence[int] | None = None, vocab_size: int | None = None,
                 target=None, tokenizer=None, **unknown):
        if unknown:
            raise ValueError(f"text_lm: unknown options {sorted(unknown)}")
        self.spec = DrafterSpec(kind="text_lm", structure=structure)
        self.lookahead = structure == "chain"
        self.predraft = self.lookahead  # ``branch``: drafting ahead for rejection outcomes too
        self.keep_tree_logits = False  # a subclass that reads a tree node's drawing row after the verdict sets it
        self._chain_path = True  # chains draw through ``_draw_chain`` (False: the general ``_draw_levels``; tests)
        if isinstance(branching, int):
            if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
                raise ValueError(f"text_lm: depth must be an integer >= 1, got {depth!r}")
            branching = (branching,) * depth
        widths = tuple(branching)
        if not widths or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in widths):
            raise ValueError(f"text_lm: branching must be an integer >= 1 or a non-empty list of them, "
                             f"got {branching!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"text_lm: seed must be an integer >= 0, got {seed!r}")
        self.widths, self.seed = widths, seed
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"text_lm: unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16'")
        dtype = getattr(torch, str(dtype)) if dtype is not None else None
        info, own_tok = {}, None
        if model is None:
            model, info = _load(path, dtype, attn_implementation)
            own_tok = _own_tokenizer(path)
        elif dtype is not None:
            model.to(dtype)
        if device is not None:
            model.to(device)
        self.model = model.eval()
        if image_token_id is None and target is not None:
            image_token_id = target.info.image_token_id
        if image_token_id is None:
            image_token_id = info.get("image_token_id")
        if image_token_id is None:
            raise ValueError("text_lm: give image_token_id (or a target) so image tokens can be dropped")
        self.image_token_id = int(image_token_id)
        self.stop_ids = stopping.stop_ids("text_lm", stop_token_ids, target, model.config.eos_token_id)  # [n_stop]
        self._stop_set = frozenset(self.stop_ids.tolist())
        self._body, head = model.base_model, model.get_output_embeddings()
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"text_lm: vocab_size must be an integer >= 1, got {vocab_size!r}")
        width = target.info.vocab_size if target is not None else vocab_size
        if target is not None and vocab_size is not None and vocab_size != width:
            raise ValueError(f"text_lm: vocab_size {vocab_size} != the target's vocabulary {width}")
        cfg = model.config
        self.vocab = check_vocab("text_lm", head.weight.shape[0], width, own_tok, as_tokenizer(tokenizer),
                                 getattr(cfg, "pad_token_id", None))
        self.vocab_size = self.vocab.width  # V of every q: the target's vocabulary
        self._attn = cfg._attn_implementation
        if not isinstance(lean, bool):
            raise ValueError(f"text_lm: lean must be true or false, got {lean!r}")
        self._lean = lean and cfg.model_type in LEAN_TYPES and lean_llama.supported(cfg)
        if self._attn not in ("sdpa", "eager"):
            raise ValueError(f"text_lm: attention {self._attn!r} cannot take custom masks; use 'sdpa' or 'eager'")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # int8 drafting covers the head too: read after the layers' weights and cache, it comes back from memory at
        # every step (measured in situ: 55-90 us per fp32 call against 16 us warm); int8 it cut draft time per
        # block by 13% on captions, reasoning and VQA for 3% of text_lm's tau (massv's unchanged), a net gain
        self._int8 = self._lean and lean_llama.int8_drafting(quantize, self.device, self._body.layers, "text_lm")
        self._head = head if self.vocab.identity and not self._int8 else _VocabHead(head, self.vocab, self._int8)
        self._kv = BatchedKV(lambda: _full_cache(cfg), kv_policy or KVPolicy())
        self._rows: dict[str, _Row] = {}  # insertion order == row order of self._kv
        self._seeder = torch.Generator().manual_seed(seed)  # for requests without a seed

    # ------------------------------------------------------------------------------------------------ protocol

    @torch.no_grad()
    def begin(self, contexts: Sequence[DraftContext]) -> None:
        """Prefill each text-only prompt (image tokens dropped); the first token becomes the tail."""
        contexts = list(contexts)
        if not contexts:
            return
        ids = [c.request_id for c in contexts]
        if len(set(ids)) != len(ids) or any(i in self._rows for i in ids):
            raise ValueError(f"text_lm.begin: request ids must be new and unique, got {ids}")
        for c in contexts:
            if not float(c.temperature) >= 0:
                raise ValueError(f"text_lm.begin: request {c.request_id!r} has temperature {c.temperature!r}")
        prompts = [c.prompt_ids[c.prompt_ids != self.image_token_id].tolist() for c in contexts]
        b, seq = len(prompts), max([len(p) for p in prompts] + [1])  # an empty prompt gets one invalid slot
        tokens = torch.zeros(b, seq, dtype=torch.long)  # [B, L]
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts])  # [B]
        valid = torch.arange(seq)[None, :] < lengths[:, None]  # [B, L] bool
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]  # [B, L, L]
        pos = torch.arange(seq).expand(b, seq)  # [B, L]
        cache = self._kv.new_cache()
        self._forward(tokens, allowed[:, None], pos, cache)
        self._kv.join(cache, valid.to(self.device))
        for c, p in zip(contexts, prompts):
            self._rows[c.request_id] = _Row(p + [int(c.first_token)], [int(c.first_token)], len(p),
                                            float(c.temperature), self._generator(c))

    @torch.no_grad()
    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        ids = tuple(request_ids)
        rows = [self._row(r) for r in ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"text_lm.propose: duplicate request ids {list(ids)}")
        if any(r.draft is not None for r in rows):
            raise ValueError("text_lm.propose: a row's previous proposal was not observed")
        widths = (1,) * gamma if self.spec.structure == "chain" else self.widths[: max(gamma, 0)]
        bc = len(ids)
        if not widths or not bc:
            return Proposal(ids, torch.zeros(bc, 1, dtype=torch.long), (0,) * bc)
        tree = _Tree.build(widths)
        index = {rid: i for i, rid in enumerate(self._rows)}
        sel = torch.tensor([index[r] for r in ids], dtype=torch.long)  # [Bc] cache rows of the call
        greedy = torch.tensor([r.temperature == 0 for r in rows])  # [Bc] bool
        temps = torch.tensor([r.temperature or 1.0 for r in rows], device=self.device)  # [Bc]
        gens = [r.generator for r in rows]

        logits = self._feed_tail(rows, sel)[:, None]  # [Bc, 1, V] the root's, after the committed context
        draft_start = self._kv.seq_len
        chain = self.spec.structure == "chain"
        level_logits = []  # chains: per level [Bc, V], kept for ``branch``'s ranking
        node_logits = []  # trees, if ``keep_tree_logits``: per level [Bc, W, V], the row each node was drawn from
        if chain and self._chain_path:
            toks, qs, oks = self._draw_chain(rows, sel, logits[:, 0], len(widths), temps, greedy, gens, level_logits)
            widths = widths[: toks[0].shape[1]]
            tree = _Tree.build(widths)
        else:
            toks, qs, oks = self._draw_levels(rows, sel, logits, widths, temps, greedy, gens, level_logits,
                                              node_logits, draft_start)
            if len(toks) < len(widths):  # every branch ended early
                widths = widths[: len(toks)]
                tree = _Tree.build(widths)
        tokens, ok = torch.cat(toks, 1), torch.cat(oks, 1)  # [Bc, N]
        n_nodes, fed = tokens.shape[1], tree.offsets[-1]
        q = None  # every row greedy: deterministic drafts
        if qs[0] is not None:  # greedy rows among sampled ones: one-hot on their tokens
            one_hot = torch.nn.functional.one_hot(tokens, self.vocab_size).float().to(self.device)  # [Bc, N, V]
            q = torch.where(greedy.to(self.device)[:, None, None], one_hot, torch.cat(qs, 1))  # [Bc, N, V]
        parents = torch.tensor(tree.parents, dtype=torch.long).expand(bc, n_nodes)  # [Bc, N]
        cols = torch.where(torch.arange(n_nodes) < fed, draft_start + torch.arange(n_nodes), -1).expand(bc, n_nodes)
        lg = torch.cat(node_logits, 1) if node_logits else None  # [Bc, N, V] trees: each node's drawing row
        if lg is not None:
            lg = _compact(tokens, parents, lg, cols, ok)[2]
        tokens, parents, q, cols, counts = _compact(tokens, parents, q, cols, ok)
        for b, (r, t, p, c, n) in enumerate(zip(rows, tokens.tolist(), parents.tolist(), cols.tolist(), counts)):
            r.draft = _Draft(t[:n], p[:n], c[:n])
            if chain:  # a chain's invalid nodes are a suffix: node i is level i
                r.draft.main, r.draft.tip = n, n - 1
                r.draft.closed = n > 0 and t[n - 1] in self._stop_set  # extend draws nothing after a stop token
                r.draft.logits = [level_logits[i][b] for i in range(n)]
            elif lg is not None:
                r.draft.logits = list(lg[b, :n])
        return Proposal(ids, tokens, tuple(counts), None if chain else parents, q)

    def _draw_levels(self, rows, sel, logits, widths, temps, greedy, gens, level_logits, node_logits,
                     draft_start: int) -> tuple[list, list, list]:
        """The draft levels of ``propose``, any tree shape: logits [Bc, 1, V] (the root's) -> per drawn level the
        tokens [Bc, W] (-1 clamped to 0), the laws [Bc, W, V] (None: every row greedy) and validity [Bc, W] bool.
        Fills ``level_logits`` (chains) / ``node_logits`` (trees kept for ranking)."""
        bc, tree = len(rows), _Tree.build(widths)
        chain = self.spec.structure == "chain"
        toks, qs, oks = [], [], []
        parent_ok = torch.ones(bc, 1, dtype=torch.bool)  # [Bc, W_prev]
        for level, k in enumerate(widths):
            kids, probs = self._children(logits, k, temps, greedy, gens)  # [Bc, W_prev, k], [Bc, W_prev, V]
            if chain:
                level_logits.append(logits[:, 0])
            elif self.keep_tree_logits:
                node_logits.append(logits.repeat_interleave(k, dim=1))
            w = kids.shape[1] * k
            kids = kids.reshape(bc, w).cpu()  # [Bc, W] BFS: a node's children contiguous, in draw order
            ok = (kids >= 0) & parent_ok.repeat_interleave(k, dim=1)  # [Bc, W] bool (-1: no mass left)
            toks.append(kids.clamp_min(0))
            qs.append(probs.repeat_interleave(k, dim=1) if probs is not None else None)  # [Bc, W, V]
            oks.append(ok)
            parent_ok = ok & ~torch.isin(kids, self.stop_ids)  # a stop token has no children
            if level + 1 < len(widths) and not parent_ok.any():  # every branch ended: no level left to feed
                break
            if level + 1 < len(widths):  # the last level is never fed
                off = tree.offsets[level]
                anc = None if chain else tree.ancestors[off:off + w, :off]  # a chain's fed nodes: all ancestors
                logits = self._feed_level(rows, sel, toks[-1], ok, level + 1, anc, draft_start)  # [Bc, W, V]
        return toks, qs, oks

    def _draw_chain(self, rows, sel, logits, gamma: int, temps, greedy, gens, level_logits
                    ) -> tuple[list, list, list]:
        """``_draw_levels`` for a chain (one node per level), its bookkeeping on the host: logits [Bc, V] (the
        root's) -> the same lists. What it draws and feeds is what ``_draw_levels`` does (a test compares them)."""
        bc, b = len(rows), self._kv.batch_size
        at = sel.tolist()
        every = bc == b and at == list(range(b))  # every cache row in the call, in order
        alive = [True] * bc  # the row's last node is valid and not a stop token
        toks, qs, oks = [], [], []
        for level in range(gamma):
            kids, probs = self._children(logits[:, None], 1, temps, greedy, gens)  # [Bc, 1, 1], [Bc, 1, V]
            level_logits.append(logits)
            drawn = kids.reshape(bc).tolist()
            ok = [a and t >= 0 for a, t in zip(alive, drawn)]
            drawn = [max(t, 0) for t in drawn]
            alive = [v and t not in self._stop_set for v, t in zip(ok, drawn)]
            toks.append(drawn)
            qs.append(probs)
            oks.append(ok)
            if level + 1 == gamma or not any(alive):
                break
            # feed this level: [3, B] host rows of tokens, positions and validity (rows outside the call: a dummy)
            fed = torch.tensor([drawn, [r.next_pos + level for r in rows], ok], dtype=torch.long)  # [3, Bc]
            if not every:
                fed = torch.zeros(3, b, dtype=torch.long).index_copy_(1, sel, fed)  # [3, B]
            mask = torch.cat([self._kv.valid, self._kv.valid.new_ones(b, 1)], dim=1)[:, None, None]  # [B,1,1,S+1]
            hidden = self._forward(fed[0, :, None], mask, fed[1, :, None], self._kv.cache)  # [B, 1, H]
            self._kv.extend_valid(fed[2, :, None].bool().to(self.device))
            logits = self._head(hidden[:, 0] if every else hidden[sel.to(self.device), 0]).float()  # [Bc, V]
        toks = [torch.tensor(toks, dtype=torch.long).T.contiguous()]  # [Bc, L]
        oks = [torch.tensor(oks, dtype=torch.bool).T.contiguous()]  # [Bc, L]
        qs = [None] if qs[0] is None else [torch.stack([q[:, 0] for q in qs], 1)]  # [Bc, L, V]
        return toks, qs, oks

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:  # check them all before changing anything
            d, path = self._row(v.request_id).draft, [int(i) for i in v.accepted]
            if len(v.tokens) != len(path) or (d is None and path):
                raise ValueError(f"text_lm.observe: {v.request_id!r}: {len(path)} accepted nodes, {len(v.tokens)} "
                                 f"tokens, {'a' if d else 'no'} proposal")
            prev = -1
            for i in path:
                if not 0 <= i < len(d.tokens) or d.parents[i] != prev:
                    raise ValueError(f"text_lm.observe: {v.request_id!r}: path {path} is not a branch")
                prev = i
            if [d.tokens[i] for i in path] != [int(t) for t in v.tokens]:
                raise ValueError(f"text_lm.observe: {v.request_id!r}: verdict tokens differ from the drafts")
        index = {rid: i for i, rid in enumerate(self._rows)}
        for v in verdicts:
            row = self._rows[v.request_id]
            d, row.draft = row.draft, None
            kept = []
            if d is not None:
                path = [int(i) for i in v.accepted]
                kept = [i for i in path if d.cols[i] >= 0]  # fed nodes are a prefix of any branch
                drop = [c for i, c in enumerate(d.cols) if c >= 0 and i not in kept]
                if drop:
                    self._kv.valid[index[v.request_id], torch.tensor(drop, device=self.device)] = False
            row.next_pos += len(kept)
            # the tail is empty after a propose; without one (a plain step) the new tokens queue behind it
            row.tail += [int(t) for t in v.tokens[len(kept):]] + [int(v.next_token)]
            row.context += [int(t) for t in v.tokens] + [int(v.next_token)]
        self._reclaim()

    @torch.no_grad()
    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        ids = tuple(request_ids)
        if not self.lookahead:
            raise ValueError("text_lm.extend: only chains can be extended")
        rows = [self._row(r) for r in ids]
        grow = [i for i, r in enumerate(rows) if r.draft is not None and r.draft.tokens and not r.draft.closed]
        new: list[list[int]] = [[] for _ in ids]
        qs: list[list[torch.Tensor | None]] = [[] for _ in ids]
        index = {rid: i for i, rid in enumerate(self._rows)}
        for _ in range(max(n, 0)):
            if not grow:
                break
            sub = [rows[i] for i in grow]
            sel = torch.tensor([index[ids[i]] for i in grow], dtype=torch.long)  # [Bc] cache rows
            logits = self._feed_tips(sub, sel)  # [Bc, V]
            greedy = torch.tensor([r.temperature == 0 for r in sub])
            temps = torch.tensor([r.temperature or 1.0 for r in sub], device=self.device)
            self._grouping([ids[i] for i in grow])
            kids, probs = self._children(logits[:, None], 1, temps, greedy, [r.generator for r in sub])
            kids = kids[:, 0, 0].tolist()  # [Bc], -1 = no mass left
            still = []
            for j, (i, r, t) in enumerate(zip(grow, sub, kids)):
                d = r.draft
                if t < 0:
                    d.closed = True
                    continue
                tip = _tip(d)
                if tip == d.main - 1 and d.main == len(d.tokens):  # growing the main chain
                    d.main += 1
                d.tokens.append(int(t))
                d.parents.append(tip)
                d.cols.append(-1)
                d.logits.append(logits[j])
                d.tip = len(d.tokens) - 1
                new[i].append(int(t))
                qs[i].append(None if probs is None or r.temperature == 0 else probs[j, 0])
                if int(t) in self._stop_set:  # a stop token ends the chain: nothing after it can be used
                    d.closed = True
                    continue
                still.append(i)
            grow = still
        return _chain_proposal(ids, new, qs, self.vocab_size, self.device)

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        landing = []
        for v in verdicts:  # check them all before changing anything
            d, k = self._row(v.request_id).draft, len(v.accepted)
            c = None
            if self.lookahead and d is not None and list(v.accepted) == list(range(k)) and k < d.main \
                    and d.tokens[:k] == [int(t) for t in v.tokens]:
                c = _landing(d, k, int(v.next_token))
            if c is None:
                raise ValueError(f"text_lm.observe_ahead: {v.request_id!r}: the verdict does not accept a prefix "
                                 "of the outstanding chain followed by its next node or an open branch's first")
            landing.append(c)
        for v, c in zip(verdicts, landing):
            row, k = self._rows[v.request_id], len(v.accepted)
            d = row.draft
            rest = _chain_after(d, c)
            if not rest or d.cols[c] < 0:  # nothing drafted past the landing node: a plain observe
                self.observe([v])
                continue
            # nodes 0..k-1 and the landing node are fed (extend feeds a node before drawing its successor): their
            # columns were computed at their final positions and stay valid, as do the rest's; the others go
            keep = set(range(k)) | {c} | set(rest)
            drop = [col for i, col in enumerate(d.cols) if col >= 0 and i not in keep]
            if drop:
                index = list(self._rows).index(v.request_id)
                self._kv.valid[index, torch.tensor(drop, device=self.device)] = False
            row.next_pos += k + 1
            row.context += d.tokens[:k] + [d.tokens[c]]
            row.draft = _Draft([d.tokens[i] for i in rest], list(range(-1, len(rest) - 1)), [d.cols[i] for i in rest],
                               closed=d.cols[rest[-1]] >= 0 or d.tokens[rest[-1]] in self._stop_set,
                               main=len(rest), tip=len(rest) - 1,
                               logits=[d.logits[i] for i in rest])
        self._reclaim()

    def branch(self, rows: Sequence[tuple[str, int]]) -> list[tuple[int, int] | None]:
        """``Predraft``: open each row's most likely rejection outcome (k, t) with k <= last, not opened yet.

        Ranking: the drafter's own probability of the outcome's path, P(d_0 .. d_{k-1}) * P_k(t), over the ALTS
        best other tokens at each main node (``outcomes``; q at the row's temperature; greedy rows: temperature 1)."""
        rows = [(rid, int(last)) for rid, last in rows]
        for rid, _ in rows:
            self._row(rid)
        out: list[tuple[int, int] | None] = []
        for rid, last in rows:
            row = self._rows[rid]
            d = row.draft
            best = None
            if self.predraft and d is not None:
                temp = row.temperature or 1.0
                best = best_outcome(lambda k: _node_rank(d, k, temp, self.image_token_id), min(last, d.main - 1),
                                    d.opened)
            if best is not None:
                self._open_branch(d, *best)
            out.append(best)
        return out

    def _open_branch(self, d: _Draft, k: int, t: int) -> None:
        """Open rejection outcome (k, t) on a draft: its first node, token t after main node k - 1."""
        lanes = _lanes(d)  # before ``closed`` below stops meaning the main chain's
        d.opened.add((k, t))
        d.tokens.append(t)
        d.parents.append(k - 1)
        d.cols.append(-1)
        d.logits.append(None)
        d.tip, d.closed = len(d.tokens) - 1, t in self._stop_set  # a stop token has no successor to draft
        if not d.closed:
            lanes.append(d.tip)

    @torch.no_grad()
    def grow(self, request_ids: Sequence[str]) -> list[list[tuple[tuple[int, int] | None, int, torch.Tensor | None]]]:
        """``Predraft`` in lockstep: one more node on every open chain of each row (the main chain past its
        outstanding proposal and each branch opened since), all of a row's tips fed in one forward as one small
        tree level. A drafter step here is bound by per-call overhead, not by width, so a pipeline that opens its
        branches first and then grows them together covers several outcomes in about the time of the main chain
        alone. Per row, one (outcome, token, q) per new node: outcome None for the main chain, else the branch's
        (k, t); q [V] fp32, None for greedy rows. A row with nothing left to grow answers []. A row drafts ahead
        either with ``extend`` or with ``grow`` between two proposals, not both."""
        ids = tuple(request_ids)
        if not self.predraft:
            raise ValueError("text_lm.grow: only chains draft ahead")
        rows = [self._row(r) for r in ids]
        out: list[list] = [[] for _ in ids]
        lanes = [list(_lanes(r.draft)) if r.draft is not None and r.draft.tokens else [] for r in rows]
        grow = [i for i, tips in enumerate(lanes) if tips]
        if not grow:
            return out
        index = {rid: i for i, rid in enumerate(self._rows)}
        sub = [rows[i] for i in grow]
        sel = torch.tensor([index[ids[i]] for i in grow], dtype=torch.long)  # [Bc] cache rows
        logits = self._feed_lanes(sub, sel, [lanes[i] for i in grow])  # [Bc, W, V]
        drawn = self._grow_children([ids[i] for i in grow], sub, logits, [len(lanes[i]) for i in grow])
        for j, i in enumerate(grow):
            d, row = sub[j].draft, sub[j]
            kids, probs = drawn[j]
            main_tip = d.main - 1
            new = []  # (lane tip, token, q): the main chain's last, since inserting it renumbers the branches
            for w, tip in enumerate(lanes[i]):
                t = int(kids[w])  # -1 = no mass left
                q = None if probs is None or row.temperature == 0 else probs[w]
                new.append((tip, t, q, logits[j, w]))
            new.sort(key=lambda x: x[0] == main_tip)
            d.lanes = []
            for tip, t, q, lg in new:
                if t < 0:
                    continue
                if tip == main_tip:
                    node = _insert_main(d, int(t), lg)
                    out[i].append((None, int(t), q))
                else:
                    d.tokens.append(int(t))
                    d.parents.append(tip)
                    d.cols.append(-1)
                    d.logits.append(lg)
                    node = len(d.tokens) - 1
                    first = _branch_first(d, node)
                    out[i].append(((d.parents[first] + 1, d.tokens[first]), int(t), q))
                if int(t) not in self._stop_set:  # a stop token ends its lane
                    d.lanes.append(node)
        return out

    def _grow_children(self, row_ids: Sequence[str], rows: list[_Row], logits: torch.Tensor, widths: list[int]
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``grow``'s draws: logits [Bc, W, V] over the rows' lanes (row j's first ``widths[j]``) -> per row (tokens
        [W_j] int64, -1 = no mass left; probs [W_j, V] the law each was drawn from, or None if greedy). Per row, over
        its own lanes only: a seeded row consumes the same draws alone or batched."""
        out = []
        for j, (row, n) in enumerate(zip(rows, widths)):
            kids, probs = self._children(logits[j:j + 1, :n], 1, torch.tensor([row.temperature or 1.0],
                                         device=self.device), torch.tensor([row.temperature == 0]), [row.generator])
            out.append((kids[0, :, 0], probs[0] if probs is not None else None))
        return out

    def release(self, request_ids: Sequence[str]) -> None:
        drop = {r for r in request_ids if r in self._rows}
        if not drop:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in drop]
        self._kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        for rid in drop:
            del self._rows[rid]
        self._reclaim()

    def _reclaim(self) -> None:
        """``BatchedKV.reclaim``: a fed draft node's column is a valid slot of its row, so compaction keeps it and
        the outstanding drafts' columns are renumbered."""
        moved = self._kv.reclaim()  # [B, S_old] int64 (CPU) or None
        if moved is None:
            return
        for b, row in enumerate(self._rows.values()):  # insertion order == cache row order
            if row.draft is not None:
                row.draft.cols = [int(moved[b, c]) if c >= 0 else -1 for c in row.draft.cols]

    def context(self, request_id: str) -> list[int]:
        """The row's committed text-only context (prompt without image tokens + committed tokens)."""
        return list(self._row(request_id).context)

    # ------------------------------------------------------------------------------------------------ internals

    def _row(self, request_id: str) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"text_lm: unknown request id {request_id!r}")
        return row

    def _generator(self, c: DraftContext) -> torch.Generator:
        return request_generator("text_lm", self.seed, c.seed, self._seeder)

    def _forward(self, tokens, allowed, pos, cache) -> torch.Tensor:
        """tokens [B, T], allowed [B, 1, T, S + T] bool, pos [B, T] -> final hidden [B, T, H]. Target ids the
        drafter lacks (>= ``vocab.shared``) are fed as ``vocab.substitute``."""
        if not self.vocab.identity:
            tokens = torch.where(tokens < self.vocab.shared, tokens, self.vocab.substitute)
        if self._lean:  # the same math without HF's per-call overhead (drafters/lean_llama.py)
            return lean_llama.model_forward(self._body, allowed.to(self.device), pos.to(self.device), cache,
                                            input_ids=tokens.to(self.device), int8=self._int8)
        out = self._body(
            input_ids=tokens.to(self.device),
            attention_mask=attention_mask(allowed.to(self.device), self._attn, self.dtype),
            position_ids=pos.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def _feed_tail(self, rows: list[_Row], sel: torch.Tensor) -> torch.Tensor:
        """Feed the call rows' tails (others ride along with an invalid dummy slot) -> logits [Bc, V] fp32."""
        b = self._kv.batch_size
        lens = torch.tensor([len(r.tail) for r in rows])  # [Bc]
        t = int(lens.max())
        tokens = torch.zeros(b, t, dtype=torch.long)  # [B, T]
        pos = torch.zeros(b, t, dtype=torch.long)  # [B, T]
        real = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
        for i, r in zip(sel.tolist(), rows):
            tokens[i, : len(r.tail)] = torch.tensor(r.tail, dtype=torch.long)
            pos[i] = r.next_pos + torch.arange(t)
            real[i, : len(r.tail)] = True
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        block = (causal[None] & real[:, None, :]) | torch.eye(t, dtype=torch.bool)[None]  # [B, T, T]
        mask = self._kv.block_mask(block.to(self.device))  # [B, 1, T, S + T]
        hidden = self._forward(tokens, mask, pos, self._kv.cache)  # [B, T, H]
        self._kv.extend_valid(real.to(self.device))
        last = hidden[sel.to(self.device), (lens - 1).to(self.device)]  # [Bc, H]
        for r in rows:
            r.next_pos += len(r.tail)
            r.tail = []
        return self._head(last).float()  # [Bc, V]

    def _feed_tips(self, rows: list[_Row], sel: torch.Tensor) -> torch.Tensor:
        """Feed each call row's draft tip (``_tip``, unfed) at its position -> logits [Bc, V] fp32 (the next node's).
        It sees the row's valid committed slots and its fed ancestors; the row's other fed draft nodes (the rest of
        the main chain past a branch point, other branches) are masked out."""
        b = self._kv.batch_size
        tok = torch.zeros(b, 1, dtype=torch.long)  # [B, 1]
        pos = torch.zeros(b, 1, dtype=torch.long)  # [B, 1]
        real = torch.zeros(b, 1, dtype=torch.bool)  # [B, 1]
        cached = self._kv.valid.clone()  # [B, S] bool
        for i, r in zip(sel.tolist(), rows):
            d = r.draft
            tip = _tip(d)
            anc = _ancestors(d, tip)
            tok[i, 0] = d.tokens[tip]
            pos[i, 0] = r.next_pos + len(anc)
            real[i, 0] = True
            hide = [c for j, c in enumerate(d.cols) if c >= 0 and j not in anc]
            if hide:
                cached[i, torch.tensor(hide, device=self.device)] = False
        own = torch.ones(b, 1, dtype=torch.bool, device=self.device)  # [B, 1]
        mask = torch.cat([cached, own], dim=1)[:, None, None]  # [B, 1, 1, S + 1]
        col = self._kv.seq_len
        hidden = self._forward(tok, mask, pos, self._kv.cache)  # [B, 1, H]
        self._kv.extend_valid(real.to(self.device))
        for r in rows:
            r.draft.cols[_tip(r.draft)] = col
        return self._head(hidden[sel.to(self.device), 0]).float()  # [Bc, V]

    def _feed_lanes(self, rows: list[_Row], sel: torch.Tensor, lanes: list[list[int]]) -> torch.Tensor:
        """``_feed_tips`` for several tips per row (``grow``): lanes[j] are call row j's unfed tips, fed side by side
        (each sees the committed slots and its own fed ancestors, not the other tips) -> logits [Bc, W, V] fp32."""
        b, w = self._kv.batch_size, max(len(t) for t in lanes)
        tok = torch.zeros(b, w, dtype=torch.long)  # [B, W]
        pos = torch.zeros(b, w, dtype=torch.long)  # [B, W]
        real = torch.zeros(b, w, dtype=torch.bool)  # [B, W]
        valid = self._kv.valid  # [B, S] bool
        cached = valid[:, None, :].expand(b, w, valid.shape[1]).clone()  # [B, W, S]
        for i, r, tips in zip(sel.tolist(), rows, lanes):
            d = r.draft
            fed = [(j, c) for j, c in enumerate(d.cols) if c >= 0]
            for x, tip in enumerate(tips):
                anc = _ancestors(d, tip)
                tok[i, x], pos[i, x], real[i, x] = d.tokens[tip], r.next_pos + len(anc), True
                hide = [c for j, c in fed if j not in anc]
                if hide:
                    cached[i, x, torch.tensor(hide, device=self.device)] = False
        eye = torch.eye(w, dtype=torch.bool, device=self.device).expand(b, w, w)
        mask = torch.cat([cached, eye], dim=2)[:, None]  # [B, 1, W, S + W]
        col = self._kv.seq_len
        hidden = self._forward(tok, mask, pos, self._kv.cache)  # [B, W, H]
        self._kv.extend_valid(real.to(self.device))
        for r, tips in zip(rows, lanes):
            for x, tip in enumerate(tips):
                r.draft.cols[tip] = col + x
        return self._head(hidden[sel.to(self.device)]).float()  # [Bc, W, V]

    def _feed_level(self, rows, sel, tokens, ok, depth: int, anc: torch.Tensor | None, draft_start: int
                    ) -> torch.Tensor:
        """Feed one tree level: tokens/ok [Bc, W], anc [W, S - draft_start] bool (None: every draft column fed so
        far is an ancestor, a chain's case) -> logits [Bc, W, V] fp32."""
        b, w = self._kv.batch_size, tokens.shape[1]
        at = torch.tensor([r.next_pos + depth - 1 for r in rows], dtype=torch.long)[:, None]  # [Bc, 1]
        every = len(rows) == b and sel.tolist() == list(range(b))  # every cache row in the call, in order
        if every:  # nothing to scatter in or gather out
            tok, block_valid, pos = tokens, ok, at.expand(b, w)
        else:
            tok = torch.zeros(b, w, dtype=torch.long)  # [B, W]
            pos = torch.zeros(b, w, dtype=torch.long)  # [B, W]
            block_valid = torch.zeros(b, w, dtype=torch.bool)  # [B, W]
            tok[sel], block_valid[sel], pos[sel] = tokens, ok, at
        valid = self._kv.valid  # [B, S] bool
        cached = valid[:, None, :].expand(b, w, valid.shape[1])  # [B, W, S]
        if anc is not None:  # this proposal's columns: a node sees its ancestors' only
            cached = cached.clone()
            cached[:, :, draft_start:] = anc.to(self.device)[None] & valid[:, None, draft_start:]
        eye = torch.eye(w, dtype=torch.bool, device=self.device).expand(b, w, w)
        mask = torch.cat([cached, eye], dim=2)[:, None]  # [B, 1, W, S + W]
        hidden = self._forward(tok, mask, pos, self._kv.cache)  # [B, W, H]
        self._kv.extend_valid(block_valid.to(self.device))
        return self._head(hidden if every else hidden[sel.to(self.device)]).float()  # [Bc, W, V]

    def _grouping(self, row_ids: Sequence[str]) -> None:
        """Called before ``extend`` draws the next node of the cache rows ``row_ids`` (in call order); a subclass
        whose ``_children`` draws for groups of rows (the ensemble's member rows) learns the groups here."""

    def _children(self, logits, k: int, temps, greedy, gens):
        """k children per node, drawn without replacement in draw order (greedy rows: top-k).

        logits [Bc, W, V] fp32 -> tokens [Bc, W, k] int64 (-1 where no mass is left), probs [Bc, W, V] fp32 (the
        law the children were drawn from) or None if every row is greedy.
        """
        logits = logits.clone()
        logits[..., self.image_token_id] = float("-inf")
        top = logits.topk(k, dim=-1).indices  # [Bc, W, k]
        if bool(greedy.all()):
            return top, None
        probs = torch.softmax(logits / temps[:, None, None], dim=-1)  # [Bc, W, V]
        drawn = sample_without_replacement(probs, k, gens)  # [Bc, W, k]
        return torch.where(greedy.to(logits.device)[:, None, None], top, drawn), probs


def _node_rank(d: _Draft, node: int, temperature: float, image_token_id: int
               ) -> tuple[float, list[tuple[int, float]]]:
    """Chain node ``node``'s ``outcomes.node_rank``, computed once, when ``branch`` first asks (the draft loop
    never pays for it). A branch's first node ranks as (1, [])."""
    if node not in d.ranked:
        row = d.logits[node]
        d.ranked[node] = (1.0, []) if row is None else node_rank(row, d.tokens[node], temperature, image_token_id)
    return d.ranked[node]


def _lanes(d: _Draft) -> list[int]:
    """The tips ``grow`` feeds, set up on first use: the main chain's tip unless it ended (its stop token, or no
    mass left), then each branch as ``branch`` opens it."""
    if d.lanes is None:
        d.lanes = [] if d.closed or d.main < len(d.tokens) else [d.main - 1]
    return d.lanes


def _insert_main(d: _Draft, token: int, logits: torch.Tensor) -> int:
    """Append a node to the main chain, which stays nodes 0 .. main-1: the branches' nodes move up by one."""
    m = d.main
    for i in range(m, len(d.parents)):
        if d.parents[i] >= m:
            d.parents[i] += 1
    d.tokens.insert(m, token)
    d.parents.insert(m, m - 1)
    d.cols.insert(m, -1)
    d.logits.insert(m, logits)
    if d.lanes is not None:
        d.lanes = [x + 1 if x >= m else x for x in d.lanes]
    d.main += 1
    return m


def _branch_first(d: _Draft, node: int) -> int:
    """The first node of the branch ``node`` (a node past the main chain) belongs to."""
    while d.parents[node] >= d.main:
        node = d.parents[node]
    return node


def _tip(d: _Draft) -> int:
    return d.tip if d.tip >= 0 else d.main - 1


def _ancestors(d: _Draft, node: int) -> set[int]:
    out, p = set(), d.parents[node]
    while p >= 0:
        out.add(p)
        p = d.parents[p]
    return out


def _landing(d: _Draft, k: int, token: int) -> int | None:
    """The node a verdict accepting main nodes 0..k-1 with next token ``token`` lands on: main node k, or the
    first node of a branch opened at k; None if neither has that token."""
    if k < d.main and d.tokens[k] == token:
        return k
    for i in range(d.main, len(d.tokens)):
        if d.parents[i] == k - 1 and d.tokens[i] == token:
            return i
    return None


def _chain_after(d: _Draft, node: int) -> list[int]:
    """The nodes drafted after ``node`` along its chain (main: the main chain; a branch: its own nodes)."""
    out = []
    while True:
        if node < d.main - 1:
            node += 1
        else:
            kids = [i for i in range(max(node + 1, d.main), len(d.tokens)) if d.parents[i] == node]
            if node == d.main - 1 or not kids:  # the main chain ends here; branches hang off earlier nodes only
                break
            node = kids[0]
        out.append(node)
    return out


def _chain_proposal(ids, new: list[list[int]], qs: list[list], vocab_size: int, device) -> Proposal:
    """New chain nodes per row (+ the law each was drawn from, None = greedy) -> a Proposal (parents None)."""
    counts = tuple(len(t) for t in new)
    width = max(max(counts, default=0), 1)
    tokens = torch.zeros(len(ids), width, dtype=torch.long)  # [B, N]
    for b, t in enumerate(new):
        tokens[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    q = None
    if any(x is not None for row in qs for x in row):  # sampled rows: their q; greedy rows: one-hot
        q = torch.zeros(len(ids), width, vocab_size, device=device)  # [B, N, V]
        for b, row in enumerate(qs):
            for i, x in enumerate(row):
                if x is None:
                    q[b, i, new[b][i]] = 1.0
                else:
                    q[b, i] = x
    return Proposal(tuple(ids), tokens, counts, None, q)


def _compact(tokens, parents, q, cols, ok):
    """Drop invalid nodes (and so their subtrees) per row, keeping order; remap parents.

    tokens/parents/cols/ok [B, N], q [B, N, V] or None -> the same, valid nodes first, counts per row.
    """
    counts = ok.sum(1).tolist()
    if all(c == ok.shape[1] for c in counts):
        return tokens, parents, q, cols, counts
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices  # [B, N] valid nodes first
    new_index = ok.long().cumsum(1) - 1  # [B, N] position of each valid node after compaction
    par = parents.gather(1, order)  # [B, N] old parent ids
    par = torch.where(par >= 0, new_index.gather(1, par.clamp_min(0)), -1)
    live = torch.arange(ok.shape[1])[None, :] < torch.tensor(counts)[:, None]  # [B, N]
    tokens = torch.where(live, tokens.gather(1, order), 0)
    par = torch.where(live, par, -1)
    cols = torch.where(live, cols.gather(1, order), -1)
    if q is not None:
        q = q.gather(1, order.to(q.device)[..., None].expand_as(q))
    return tokens, par, q, cols, counts


# model types whose decoder layers are Llama's op for op (no attention / MLP bias: Qwen2's q/k/v bias is not)
LEAN_TYPES = frozenset({"llama", "mistral"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class _VocabHead(nn.Module):
    """The drafter's LM head, its logits put on the target's vocabulary: ids >= ``shared`` are -inf (q = 0 there)
    and the width is the target's, padded with -inf or cut. hidden [..., H] -> logits [..., V] fp32. ``int8``: the
    head's product over an int8 copy of its weight (``int8_weights.linear``)."""

    def __init__(self, head: nn.Module, vocab: VocabMap, int8: bool = False):
        super().__init__()
        self.head, self.vocab, self.int8 = head, vocab, int8

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raw = int8_weights.linear(self.head, hidden) if self.int8 else self.head(hidden)  # [..., V_drafter]
        if self.vocab.identity:
            return raw
        logits = raw[..., : self.vocab.shared].float()  # [..., shared]
        pad = logits.new_full((*logits.shape[:-1], self.vocab.width - self.vocab.shared), float("-inf"))
        return torch.cat([logits, pad], dim=-1)  # [..., V]


def _full_cache(config) -> DynamicCache:
    """A cache of full-attention layers: ``targets.kv.BatchedKV`` keeps every slot, so a sliding-window layer
    (Mistral's ``sliding_window``) would drop the ones its masks still name; the drafter attends its whole context."""
    cache = growable_cache(config)  # appends in place: a stock layer copies the whole cache every draft step
    if all(type(layer) is GrowableLayer for layer in cache.layers):
        return cache
    return DynamicCache()  # layers made on first use, all DynamicLayer


def _own_tokenizer(path):
    """The tokenizer saved beside the drafter's weights, or None when the directory has none. A tokenizer.json is
    read as it is (``AutoTokenizer`` would pick the class of the model type, e.g. Qwen2's, which adds its own
    special tokens to whatever the file holds)."""
    from transformers import PreTrainedTokenizerFast

    from specula.zoo.store import resolve

    d = resolve(path)
    if (d / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(d, local_files_only=True)
    if not any((d / f).exists() for f in TOKENIZER_FILES):
        return None
    return as_tokenizer(str(d))


def _load(path, dtype, attn_implementation):
    """Any causal LM transformers knows, from a local directory (no remote code) -> (model, its specula.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from specula.zoo.store import resolve

    d = resolve(path)
    kind = AutoConfig.from_pretrained(d, local_files_only=True).model_type
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"text_lm: {d} holds a {kind!r} model, not a causal LM checkpoint (Llama, Qwen2, Mistral, "
                         "...; AutoModelForCausalLM)")
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype or "auto", attn_implementation=attn_implementation,
                                                 local_files_only=True)
    meta = d / "specula.json"
    return model, (json.loads(meta.read_text()) if meta.exists() else {})
