"""VerifierEngine + DrafterServer over real gRPC on 127.0.0.1, no Ray: the distributed loop must give exactly the
tokens of the single-process SpecEngine with the same drafter, keep giving them when the drafter dies, stalls or
cannot be reached (it decodes alone), and fail a request explicitly when the target fails."""

from __future__ import annotations

import threading
import time

import pytest

from specula.runtime.dataplane import DrafterServer, RemoteDrafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.factory import make_drafter
from specula.runtime.serve.verifier import VerifierEngine, VerifierError
from specula.targets import load_target

from serve_kit import make_config, world_requests

DRAFTERS = {
    "ngram": {"kind": "ngram", "options": {"max_n": 3}},
    "random": {"kind": "random", "options": {"peaked": 3.0, "seed": 3}},
    "random_tree": {"kind": "random", "options": {"peaked": 3.0, "seed": 3, "structure": "tree", "branching": 2,
                                                  "depth": 3}},
}


def _config(model_dir, processor, kind: str, **drafter):
    d = {**DRAFTERS[kind], **drafter}
    if kind.startswith("random"):  # never propose the image placeholder (as the engine tests do)
        d["options"] = {**d["options"], "banned": [processor.tokenizer.convert_tokens_to_ids("<image>")]}
    return make_config(model_dir, d)


def _reference(model_dir, cfg, reqs, eos=None):
    """The single-process engine, one request at a time, with a fresh drafter built from the same config."""
    eng = SpecEngine(load_target(model_dir), make_drafter(cfg), gamma=cfg.drafter.gamma, eos_token_ids=eos)
    return {r.request_id: eng.generate([r])[r.request_id] for r in reqs}


def _sessions_end(server, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while server.live_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.live_sessions == 0


def _verifier(model_dir, cfg, eos=None, **remote) -> VerifierEngine:
    target = load_target(model_dir)
    opts = {"propose_timeout_s": 5.0, "connect_timeout_s": 2.0, **remote}
    return VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, **opts), gamma=cfg.drafter.gamma,
                          eos_token_ids=eos)


@pytest.mark.parametrize("kind, temperature", [("ngram", 0.0), ("random", 0.0), ("random_tree", 0.0),
                                               ("random", 1.0), ("random_tree", 1.0)])
def test_tokens_and_blocks_equal_the_single_process_engine(model_dir, processor, kind, temperature):
    """Greedy, and sampled with a seed: q crosses the wire exactly, so even the random draws line up."""
    cfg = _config(model_dir, processor, kind)
    reqs = world_requests(processor, 3, SamplingParams(temperature=temperature, seed=7, max_tokens=20))
    ref = _reference(model_dir, cfg, reqs)
    verifier = _verifier(model_dir, cfg)
    try:
        with DrafterServer(make_drafter(cfg)) as server:
            for r in reqs:
                got = verifier.generate(r, drafter_address=server.address)
                assert got["tokens"] == ref[r.request_id].tokens, r.request_id
                assert got["drafter"] == "ok"
                # the same drafts were proposed and judged: block for block the same run
                m, want = got["metrics"], ref[r.request_id].metrics
                assert (m["blocks"], m["draft_tokens"], m["accepted_tokens"]) == \
                       (want.blocks, want.draft_tokens, want.accepted_tokens)
            assert _sessions_end(server)  # Release travels after the last token; the session ends soon after
    finally:
        verifier.close()
    assert not verifier.target.live_ids


def test_concurrent_requests_share_the_loop_and_keep_their_tokens(model_dir, processor):
    cfg = _config(model_dir, processor, "ngram")
    reqs = world_requests(processor, 4, SamplingParams(max_tokens=16), start=3)
    ref = _reference(model_dir, cfg, reqs)
    verifier = _verifier(model_dir, cfg)
    got: dict[str, list[int]] = {}
    try:
        with DrafterServer(make_drafter(cfg)) as server:
            def run(r):
                got[r.request_id] = verifier.generate(r, drafter_address=server.address)["tokens"]
            threads = [threading.Thread(target=run, args=(r,)) for r in reqs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    finally:
        verifier.close()
    assert got == {r.request_id: ref[r.request_id].tokens for r in reqs}


def test_drafter_killed_mid_generation_output_unchanged(model_dir, processor):
    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=40), start=1)[0]
    ref = _reference(model_dir, cfg, [req], eos=[-1])[req.request_id].tokens
    verifier = _verifier(model_dir, cfg, eos=[-1])
    server = DrafterServer(make_drafter(cfg))
    server.start()
    tokens, chunks = [], []
    try:
        for chunk in verifier.stream(req, drafter_address=server.address):
            chunks.append(chunk)
            tokens.extend(chunk["tokens"])
            if len(chunks) == 2:
                server.stop()  # the replica dies with the session open
    finally:
        server.stop()
        verifier.close()
    assert tokens == ref and len(tokens) == 40
    assert chunks[-1]["drafter"].startswith("fallback")
    assert chunks[-1]["metrics"]["blocks"] > 2


class _Stalling:
    """A drafter that stops answering in time after ``after`` proposals."""

    def __init__(self, inner, after: int, delay: float) -> None:
        self.inner, self.after, self.delay, self.calls = inner, after, delay, 0
        self.spec = inner.spec

    def begin(self, contexts):
        self.inner.begin(contexts)

    def propose(self, request_ids, gamma):
        self.calls += 1
        if self.calls > self.after:
            time.sleep(self.delay)
        return self.inner.propose(request_ids, gamma)

    def observe(self, verdicts):
        self.inner.observe(verdicts)

    def release(self, request_ids):
        self.inner.release(request_ids)


def test_slow_drafter_times_out_and_request_decodes_alone(model_dir, processor):
    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=24), start=2)[0]
    ref = _reference(model_dir, cfg, [req], eos=[-1])[req.request_id].tokens
    verifier = _verifier(model_dir, cfg, eos=[-1], propose_timeout_s=0.2)
    try:
        with DrafterServer(_Stalling(make_drafter(cfg), after=2, delay=0.6)) as server:
            t0 = time.monotonic()
            got = verifier.generate(req, drafter_address=server.address)
            elapsed = time.monotonic() - t0
    finally:
        verifier.close()
    assert got["tokens"] == ref
    assert "no answer within" in got["drafter"]
    assert elapsed < 5  # one missed deadline, not one per step


def test_unreachable_drafter_decodes_alone(model_dir, processor):
    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=12))[0]
    ref = _reference(model_dir, cfg, [req])[req.request_id].tokens
    server = DrafterServer(make_drafter(cfg))
    address = server.start()
    server.stop()  # nothing listens there any more
    verifier = _verifier(model_dir, cfg, connect_timeout_s=0.5)
    try:
        got = verifier.generate(req, drafter_address=address)
        other = world_requests(processor, 1, SamplingParams(max_tokens=12), start=6)[0]
        none = verifier.generate(other, drafter_address=None)
    finally:
        verifier.close()
    assert got["tokens"] == ref
    assert got["drafter"].startswith("fallback") and none["drafter"] == "fallback: no drafter replica"


class _FailingTarget:
    """A target that raises on its ``fail_at``-th call of the methods named in ``calls`` (then works again)."""

    def __init__(self, inner, fail_at: int, calls: tuple[str, ...] = ("verify", "decode_step")) -> None:
        self.inner, self.fail_at, self.calls, self.watched = inner, fail_at, 0, calls

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.watched:
            return attr

        def ticking(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("simulated device failure")
            return attr(*args, **kwargs)

        return ticking


@pytest.mark.parametrize("fails", ["verify", "prefill"])
def test_target_failure_is_an_explicit_error_and_the_engine_goes_on(model_dir, processor, fails):
    """A target failure mid-request (verify) or in the prefill, after the drafter session began early (the ngram
    replica offers early Begin): the client gets the error, the request's state is freed on both sides, and the
    next request decodes as before."""
    cfg = _config(model_dir, processor, "ngram")
    first, second = world_requests(processor, 2, SamplingParams(max_tokens=16))
    ref = _reference(model_dir, cfg, [second])[second.request_id].tokens
    inner = load_target(model_dir)
    target = _FailingTarget(inner, fail_at=3) if fails == "verify" else _FailingTarget(inner, 1, ("prefill",))
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=inner.info.vocab_size), gamma=cfg.drafter.gamma)
    try:
        with DrafterServer(make_drafter(cfg)) as server:
            assert server.info.early_begin
            seen = []
            with pytest.raises(VerifierError, match="simulated device failure"):
                for chunk in verifier.stream(first, drafter_address=server.address):
                    seen.append(chunk)
            if fails == "verify":  # tokens came, then the error: never a quiet short answer
                assert seen and not seen[-1]["finished"]
            else:
                assert not seen
            assert not inner.live_ids
            assert _sessions_end(server)  # the failed request's session was freed too
            out = verifier.generate(second, drafter_address=server.address)
            assert out["tokens"] == ref and out["dataplane"]["early"]
            assert _sessions_end(server)
    finally:
        verifier.close()


class _Misbehaving(_Stalling):
    """A drafter that, from its third proposal on, answers wrongly in one of several ways."""

    def __init__(self, inner, how: str, vocab: int) -> None:
        super().__init__(inner, after=10**9, delay=0.0)
        self.how, self.vocab = how, vocab

    def propose(self, request_ids, gamma):
        import torch

        from specula.drafters.protocol import Proposal

        self.calls += 1
        if self.calls < 3:
            return self.inner.propose(request_ids, gamma)
        if self.how == "crash":
            raise RuntimeError("drafter model exploded")
        n = gamma + 3 if self.how == "too_long" else gamma
        tokens = torch.full((1, n), self.vocab + 5 if self.how == "out_of_vocab" else 3, dtype=torch.long)
        q = torch.full((1, n, self.vocab), float("nan")) if self.how == "nan_q" else None
        return Proposal(tuple(request_ids), tokens, (n,), None, q)


@pytest.mark.parametrize("how", ["crash", "out_of_vocab", "too_long", "nan_q"])
def test_misbehaving_drafter_is_dropped_and_output_unchanged(model_dir, processor, how):
    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=20), start=4)[0]
    ref = _reference(model_dir, cfg, [req], eos=[-1])[req.request_id].tokens
    verifier = _verifier(model_dir, cfg, eos=[-1])
    try:
        drafter = _Misbehaving(make_drafter(cfg), how, verifier.target.info.vocab_size)
        with DrafterServer(drafter) as server:
            got = verifier.generate(req, drafter_address=server.address)
            assert _sessions_end(server)
    finally:
        verifier.close()
    assert got["tokens"] == ref
    assert got["drafter"].startswith("fallback"), got["drafter"]


class _Recording(_Stalling):
    """Asks for the target's hidden states and visual features, and keeps what it is given."""

    def __init__(self, inner) -> None:
        from specula.drafters.protocol import DrafterSpec

        super().__init__(inner, after=10**9, delay=0.0)
        self.spec = DrafterSpec(kind="ngram", structure="chain", needs=frozenset({"hidden", "visual"}))
        self.begun, self.verdicts = [], []

    def begin(self, contexts):
        self.begun += [(c.hidden, c.visual) for c in contexts]
        self.inner.begin(contexts)

    def observe(self, verdicts):
        self.verdicts += [v.hidden for v in verdicts]
        self.inner.observe(verdicts)


@pytest.mark.parametrize("codec, tol", [("fp32", 0.0), ("fp16", 2e-3), ("int8+zstd", 2e-2)])
def test_features_reach_the_drafter_in_the_negotiated_codec(model_dir, processor, codec, tol):
    import torch

    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=12))[0]  # a VQA prompt: it has an image
    local = _Recording(make_drafter(cfg))
    want = SpecEngine(load_target(model_dir), local, gamma=4).generate([req])[req.request_id].tokens
    verifier = _verifier(model_dir, cfg, codec_preference=[codec, "fp32"])
    try:
        with DrafterServer(_Recording(make_drafter(cfg)), accept_codecs=[codec]) as server:
            got = verifier.generate(req, drafter_address=server.address)
            assert _sessions_end(server)  # the last Verdict and the Release have been handled
            remote = server.drafter
    finally:
        verifier.close()
    assert got["tokens"] == want and got["drafter"] == "ok"  # lossy features never change the output
    pairs = [(a, b) for (la, lb), (ra, rb) in zip(local.begun, remote.begun) for a, b in ((la, ra), (lb, rb))]
    pairs += list(zip(local.verdicts, remote.verdicts))
    assert len(pairs) == 2 + len(local.verdicts) and len(remote.verdicts) == len(local.verdicts) > 1
    for exact, seen in pairs:  # prompt hidden [L, H], visual [N_img, T, H], then verdict hidden [1 + k, H]
        assert seen.shape == exact.shape and seen.dtype == exact.dtype
        scale = exact.abs().amax().clamp_min(1e-6)
        err = float((seen - exact).abs().amax() / scale)
        assert err <= tol, (codec, err)
    if tol:
        assert any(not torch.equal(a, b) for a, b in pairs)  # the lossy codec really was used


def test_a_client_that_leaves_early_frees_the_request_everywhere(model_dir, processor):
    cfg = _config(model_dir, processor, "ngram")
    req = world_requests(processor, 1, SamplingParams(max_tokens=200), start=1)[0]
    verifier = _verifier(model_dir, cfg, eos=[-1])
    try:
        with DrafterServer(make_drafter(cfg)) as server:
            stream = verifier.stream(req, drafter_address=server.address)
            next(stream), next(stream)
            stream.close()  # the HTTP client went away
            deadline = time.monotonic() + 5
            while (verifier.target.live_ids or server.live_sessions) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not verifier.target.live_ids and server.live_sessions == 0
            assert server.drafter._tokens == {}
    finally:
        verifier.close()
