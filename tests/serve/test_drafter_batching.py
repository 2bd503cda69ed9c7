"""Cross-session batching in the DrafterServer (runtime/dataplane/batcher.py), over real gRPC on 127.0.0.1.

Several sessions' drafter calls run as one batched drafter call, each session getting exactly its own row: the
same tokens and q as drafting alone (seeded sampled rows included: every drafter draws a row from its request's
own generator); greedy requests through the VerifierEngine still equal plain decoding, seeded sampled ones the
single-process engine; a drafter failure fails only the sessions whose rows were in the failing call (their
verifier decodes alone, output unchanged) and the server keeps serving.

Over direct Session streams batches are made deterministic, not timed: a wrapper holds the first propose until
the other sessions' proposes are pending (``server.batcher.pending("propose")``), so the next call carries them.
Through the VerifierEngine a short batching window is used instead (see WINDOW below).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

from specula.drafters import create
from specula.drafters.protocol import DraftContext, Verdict, supports_lookahead
from specula.protos import load
from specula.runtime.dataplane import DrafterServer, RemoteDrafter, SessionStream
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.verifier import VerifierEngine
from specula.targets import load_target
from specula.runtime.wire import DEFAULT_LIMITS, pb

from serve_kit import world_requests

pb2_grpc = load("specula_dataplane").pb2_grpc
GAMMA = 4


class _Counting:
    """A drafter wrapper that records each call's kind and rows, can hold the first call of a kind until a
    condition holds (bounded), and can fail chosen calls."""

    def __init__(self, inner) -> None:
        self.inner, self.spec = inner, inner.spec
        self.lookahead = supports_lookahead(inner)
        self.calls: list[tuple[str, list]] = []  # (op, row keys)
        # op -> rule(rows of this call): True = go on, rule done; None = go on, rule kept for a later call;
        # False = not yet (wait, bounded)
        self.hold: dict[str, object] = {}
        self.fail = None  # f(op, keys) -> bool: raise instead of calling the drafter
        self.live: set[str] = set()  # begun, not released

    def _enter(self, op: str, keys: list) -> None:
        rule = self.hold.get(op)
        if rule is not None:
            deadline = time.monotonic() + 20  # a bound, not a timing: the rule decides in milliseconds
            while (verdict := rule(len(keys))) is False and time.monotonic() < deadline:
                time.sleep(0.005)
            if verdict is not None:
                self.hold.pop(op, None)
        self.calls.append((op, list(keys)))
        self.live |= set(keys) if op == "begin" else set()
        self.live -= set(keys) if op == "release" else set()
        if self.fail is not None and self.fail(op, keys):
            raise RuntimeError(f"injected drafter failure in {op} of {len(keys)} rows")

    def sizes(self, op: str) -> list[int]:
        return [len(k) for o, k in self.calls if o == op]

    def begin(self, contexts):
        self._enter("begin", [c.request_id for c in contexts])
        self.inner.begin(contexts)

    def propose(self, request_ids, gamma):
        self._enter("propose", request_ids)
        return self.inner.propose(request_ids, gamma)

    def observe(self, verdicts):
        self._enter("observe", [v.request_id for v in verdicts])
        self.inner.observe(verdicts)

    def release(self, request_ids):
        self._enter("release", request_ids)
        self.inner.release(request_ids)

    def extend(self, request_ids, n):
        self._enter("extend", request_ids)
        return self.inner.extend(request_ids, n)

    def observe_ahead(self, verdicts):
        self._enter("observe_ahead", [v.request_id for v in verdicts])
        self.inner.observe_ahead(verdicts)

    @property
    def predraft(self) -> bool:
        return bool(getattr(self.inner, "predraft", False))

    def branch(self, rows):
        self._enter("branch", [r for r, _ in rows])
        return self.inner.branch(rows)

    def grow(self, request_ids):
        self._enter("grow", request_ids)
        return self.inner.grow(request_ids)


def _text_lm(model_dir):
    """The target's own language model as a text_lm drafter (drafts ahead: overlap)."""
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    lm = LlamaForCausalLM(hf.config.text_config)
    lm.model.load_state_dict(hf.model.language_model.state_dict())
    lm.lm_head.weight.data.copy_(hf.lm_head.weight.data)
    return create({"kind": "text_lm", "model": lm.eval()}, target=load_target(model_dir))


@pytest.fixture(scope="module")
def lively(tmp_path_factory, processor):
    """The tiny LLaVA with larger LM weights: answers vary, so drafts are partly rejected."""
    from specula.targets.embedded_arch import TargetArch, build_model

    out = tmp_path_factory.mktemp("lively_batching")
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.model.language_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _wait(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


# ------------------------------------------------------------------------------------------------ direct streams


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [5, 9, 13, 17, 21, 25, 29], [40, 41, 42]]
# (temperature, seed): greedy and sampled rows mixed. Every row is seeded: an unseeded request's seed comes from the
# drafter's own seeder in begin order, and concurrent begins come in no fixed order (batcher.py)
SAMPLING = [(0.0, 1), (1.0, 3), (0.0, 2), (1.0, 11)]


def _begin(i: int) -> pb.Begin:
    t, seed = SAMPLING[i]
    sampling = pb.SamplingParams(temperature=t)
    if seed is not None:
        sampling.seed = seed
    return pb.Begin(prompt_ids=PROMPTS[i], first_token=PROMPTS[i][-1] + 1, sampling=sampling, codec="fp32")


def _alone(make, i: int, verdicts: list[tuple]) -> list[tuple[list[int], torch.Tensor | None]]:
    """Session i drafted by a fresh drafter on its own: a proposal, then one per verdict."""
    d = make()
    t, seed = SAMPLING[i]
    d.begin([DraftContext("x", torch.tensor(PROMPTS[i]), PROMPTS[i][-1] + 1, t, seed)])
    out = []
    for step in range(len(verdicts) + 1):
        p = d.propose(["x"], GAMMA)
        c = p.counts[0]
        out.append((p.tokens[0, :c].tolist(), p.q[0, :c] if p.q is not None else None))
        if step < len(verdicts):
            acc, nxt = verdicts[step]
            toks = out[-1][0]
            d.observe([Verdict("x", tuple(range(acc)), tuple(toks[:acc]), nxt)])
    return out


@pytest.mark.parametrize("kind", ["random", "text_lm"])
def test_sessions_share_one_propose_call_and_each_gets_its_own_row(model_dir, processor, kind):
    """Four sessions, greedy and seeded-sampled mixed: their ProposeRequests run as one batched propose, and each
    session gets what its request drafts alone (tokens exactly, q to float precision; greedy rows carry no q)."""
    banned = processor.tokenizer.convert_tokens_to_ids("<image>")
    make = {"random": lambda: create({"kind": "random", "vocab_size": 64, "peaked": 3.0, "seed": 5,
                                      "banned": [banned] if banned < 64 else []}),
            "text_lm": lambda: _text_lm(model_dir)}[kind]
    n = len(PROMPTS)
    wrapper = _Counting(make())
    verdicts = [(1, 3), (0, 7)]  # per round: (accepted prefix, next token)
    with DrafterServer(wrapper, overlap=False) as server:
        channel = grpc.insecure_channel(server.address, options=DEFAULT_LIMITS.grpc_options())
        stub = pb2_grpc.DrafterServiceStub(channel)
        streams = [SessionStream(stub, f"r{i}", "fp32", DEFAULT_LIMITS) for i in range(n)]
        try:
            for i, s in enumerate(streams):
                s.send(_begin(i))
            assert _wait(lambda: sum(wrapper.sizes("begin")) == n)
            got: list[list] = [[] for _ in range(n)]
            for rnd in range(len(verdicts) + 1):
                # the first propose of round 0 waits until the other sessions' proposes are pending
                if rnd == 0:
                    wrapper.hold["propose"] = lambda k: k + server.batcher.pending("propose") >= n
                for s in streams:
                    s.send(pb.ProposeRequest(gamma=GAMMA))
                for i, s in enumerate(streams):
                    m = s.receive(30)
                    assert m.kind == "proposal", m.body
                    got[i].append((list(m.body.tokens), m.tensors.get("q")))
                if rnd < len(verdicts):
                    acc, nxt = verdicts[rnd]
                    for i, s in enumerate(streams):
                        s.send(pb.Verdict(accepted=list(range(acc)), tokens=got[i][-1][0][:acc], next_token=nxt))
            for s in streams:
                s.finish("done")
            assert _wait(lambda: server.live_sessions == 0)
        finally:
            channel.close()
    # the first propose waited until every session's rows were in it or pending: the next call carries the rest
    sizes = wrapper.sizes("propose")
    assert max(sizes) > 1 and (sizes[0] == n or sizes[0] + sizes[1] == n), wrapper.calls
    for i in range(n):
        want = _alone(make, i, verdicts)
        for (tokens, q), (want_tokens, want_q) in zip(got[i], want):
            assert tokens == want_tokens, (i, got[i], want)
            if want_q is None:
                assert q is None  # (text_lm) a greedy row batched with sampled ones still sends no q
            else:
                torch.testing.assert_close(q, want_q.float(), atol=1e-5, rtol=1e-4)


def test_max_batch_size_splits_a_group_and_a_failing_call_fails_only_its_sessions():
    """max_batch_size=2 with four sessions proposing at once: no call has more than 2 rows, and one has 2. The
    2-row calls fail (injected): exactly their sessions get an Error naming the failure, the others their
    Proposal; every session is freed and a new session is served afterwards."""
    prompt = [5, 6, 7, 5, 6]
    wrapper = _Counting(create({"kind": "ngram", "max_n": 3}))
    n = 4
    with DrafterServer(wrapper, overlap=False, max_batch_size=2) as server:
        channel = grpc.insecure_channel(server.address, options=DEFAULT_LIMITS.grpc_options())
        stub = pb2_grpc.DrafterServiceStub(channel)
        streams = [SessionStream(stub, f"r{i}", "fp32", DEFAULT_LIMITS) for i in range(n)]
        try:
            for s in streams:
                s.send(pb.Begin(prompt_ids=prompt, first_token=7, codec="fp32"))
            assert _wait(lambda: sum(wrapper.sizes("begin")) == n)
            # a 2-row call is already what we want; a 1-row call waits for the others (the chunks of one pass are
            # not pending: they are in the pass)
            wrapper.hold["propose"] = lambda k: k == 2 or k + server.batcher.pending("propose") >= n - 1
            wrapper.fail = lambda op, keys: op == "propose" and len(keys) == 2
            for s in streams:
                s.send(pb.ProposeRequest(gamma=3))
            answers = []
            for s in streams:
                try:
                    m = s.receive(30)
                    answers.append(("proposal", list(m.body.tokens)))
                except Exception as e:  # DrafterUnavailable: the Error frame
                    answers.append(("error", str(e)))
            wrapper.fail = None
            sizes = wrapper.sizes("propose")
            assert sum(sizes) == n and max(sizes) == 2, wrapper.calls  # never more than 2 rows; one call of 2
            errors = [a for a in answers if a[0] == "error"]
            assert len(errors) == 2 * sizes.count(2), (answers, sizes)  # exactly the rows of the failed calls
            assert all("CODE_INTERNAL" in e and "injected drafter failure" in e for _, e in errors), answers
            assert [a for a in answers if a[0] == "proposal"] == [("proposal", [5, 6, 7])] * sizes.count(1)
            for s in streams:
                s.finish("done")
            assert _wait(lambda: server.live_sessions == 0)
            assert wrapper.inner._tokens == {}  # failed sessions were released too
            s = SessionStream(stub, "late", "fp32", DEFAULT_LIMITS)
            s.send(pb.Begin(prompt_ids=prompt, first_token=7, codec="fp32"))
            s.send(pb.ProposeRequest(gamma=2))
            assert list(s.receive(30).body.tokens) == [5, 6]
            s.finish("done")
        finally:
            channel.close()


# ------------------------------------------------------------------------------------------------ through the verifier


def _verifier(model_dir, gamma=GAMMA, overlap=None) -> VerifierEngine:
    target = load_target(model_dir)
    return VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=30.0,
                                                overlap=overlap), gamma=gamma)


# The verifier sends a ProposeRequest to every row of a step back to back; a short window lets the drafting worker
# gather them (the pass closes as soon as max_batch_size calls are pending). Holding a call until others are
# pending would be deterministic but can deadlock here: the verifier waits for the held row's Proposal, and not
# every live row proposes in every step (a row near max_tokens asks for fewer nodes or none), so the multi-row
# propose is asserted deterministically over direct streams above and only checked to happen here.
WINDOW = {"batch_wait_ms": 30, "max_batch_size": 4}


def _concurrently(verifier, reqs, address) -> dict:
    got = {}

    def one(r):
        got[r.request_id] = verifier.generate(r, drafter_address=address)

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


@pytest.mark.parametrize("predraft", [0, 3])
def test_concurrent_requests_batched_with_overlap_equal_plain_decoding(lively, processor, predraft):
    """Five greedy requests at once through the VerifierEngine, text_lm drafting ahead (proposes and the drafting
    ahead's extends batched as they come; with predraft, branches opened and grown in lockstep, ``grow`` calls
    batched the same way): every output equals plain decoding, every request really drafted."""
    reqs = world_requests(processor, 5, SamplingParams(max_tokens=16), start=1)
    plain = SpecEngine(load_target(lively), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    wrapper = _Counting(_text_lm(lively))
    assert wrapper.lookahead
    verifier = _verifier(lively)
    try:
        with DrafterServer(wrapper, overlap=True, predraft=predraft, **WINDOW) as server:
            got = _concurrently(verifier, reqs, server.address)
            assert _wait(lambda: server.live_sessions == 0)
    finally:
        verifier.close()
    assert {r: g["tokens"] for r, g in got.items()} == want
    assert all(g["drafter"] == "ok" for g in got.values()), {r: g["drafter"] for r, g in got.items()}
    ahead = "grow" if predraft else "extend"  # drafted, and drafted ahead, through the batcher
    assert wrapper.sizes("propose") and wrapper.sizes(ahead) and not wrapper.sizes("extend" if predraft else "grow")
    if predraft:
        assert all(n % predraft == 0 for n in wrapper.sizes("branch"))  # every session opens its branches at once
    assert wrapper.live == set() and wrapper.inner._rows == {}  # every session released


def test_seeded_sampled_requests_batched_repeat_the_single_process_engine(model_dir, processor):
    """Four seeded sampled requests at once (overlap off), a sampled random drafter: each request gets exactly
    the tokens the single-process engine gives it alone, so batching moved no row's random numbers."""
    banned = processor.tokenizer.convert_tokens_to_ids("<image>")
    spec = {"kind": "random", "peaked": 3.0, "seed": 3, "banned": [banned]}
    reqs = world_requests(processor, 4, SamplingParams(temperature=1.0, seed=7, max_tokens=16))
    target = load_target(model_dir)
    ref = SpecEngine(target, create({**spec, "vocab_size": target.info.vocab_size}), gamma=GAMMA)
    want = {r.request_id: ref.generate([r])[r.request_id].tokens for r in reqs}
    for _ in range(2):  # and again: a seeded batched run repeats
        wrapper = _Counting(create({**spec, "vocab_size": target.info.vocab_size}))
        verifier = _verifier(model_dir, overlap=False)
        try:
            with DrafterServer(wrapper, overlap=False, **WINDOW) as server:
                got = _concurrently(verifier, reqs, server.address)
        finally:
            verifier.close()
        # a seed reproduces a row's draws whatever shares its batch; the target's forward over another batch shape
        # may still differ in the last bits and flip a rare near-tie draw (runtime/core/sampling.py), so allow one row
        same = sum(got[r]["tokens"] == want[r] for r in want)
        assert same >= len(want) - 1, ({r: g["tokens"] for r, g in got.items()}, want)
        assert all(g["drafter"] == "ok" for g in got.values())
        # (that proposals really batch is proven deterministically by the direct-stream test above)


def test_a_failing_batched_call_sends_its_requests_to_plain_decoding_and_the_rest_go_on(model_dir, processor):
    """Through the VerifierEngine: a propose call fails (the first with three sessions live). Exactly its
    requests fall back (decode alone, the drafter's error in the reason), every output still equals plain
    decoding, the others keep drafting, and a new request afterwards drafts again."""
    reqs = world_requests(processor, 4, SamplingParams(max_tokens=16), start=2)
    plain = SpecEngine(load_target(model_dir), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    wrapper = _Counting(create({"kind": "ngram", "max_n": 3}))
    failed: list[list] = []

    def fail(op, keys):  # the first propose while three sessions are live (its rows: one or more)
        if op == "propose" and len(wrapper.live) >= 3 and not failed:
            failed.append(list(keys))
            return True
        return False

    verifier = _verifier(model_dir, overlap=False)
    try:
        with DrafterServer(wrapper, overlap=False, **WINDOW) as server:
            wrapper.fail = fail
            got = _concurrently(verifier, reqs, server.address)
            assert _wait(lambda: server.live_sessions == 0)
            assert wrapper.inner._tokens == {}
            wrapper.fail = None
            late = world_requests(processor, 1, SamplingParams(max_tokens=12), start=5)[0]
            late_got = verifier.generate(late, drafter_address=server.address)
    finally:
        verifier.close()
    assert {r: g["tokens"] for r, g in got.items()} == want
    assert failed
    fell_back = {r for r, g in got.items() if g["drafter"] != "ok"}
    assert len(fell_back) == len(failed[0]), {r: g["drafter"] for r, g in got.items()}
    assert all("injected drafter failure" in got[r]["drafter"] for r in fell_back)
    assert late_got["drafter"] == "ok"
    assert late_got["tokens"] == plain.generate([late])[late.request_id].tokens


def test_config_sets_the_batching_and_rejects_bad_values(model_dir):
    from specula.runtime.config import ConfigError

    from serve_kit import make_config

    cfg = make_config(model_dir, dataplane={"max_batch_size": 3, "batch_wait_ms": 1.5})
    server = DrafterServer.from_config(cfg)
    assert (server.batcher.max_batch_size, server.batcher.wait_s) == (3, 0.0015)
    assert make_config(model_dir).dataplane.batch_wait_ms == 0.0  # default: no window
    for bad in ({"max_batch_size": 0}, {"batch_wait_ms": -1}):
        with pytest.raises(ConfigError, match=f"dataplane.{next(iter(bad))}"):
            make_config(model_dir, dataplane=bad)
