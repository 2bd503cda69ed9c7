"""The verifier decodes on the process's compute thread (runtime/engine/compute_thread.py) and loads its models
there: every torch call of a serving replica stays on one thread, because torch's OpenMP kernels run about half as
fast on a small machine once a second thread of the process has used them (see the module's doc). A bug in the
verifier's step fails its requests with VerifierError and makes it unhealthy, and the thread goes on for others."""

from __future__ import annotations

import threading

import pytest
import torch

from serve_kit import make_config, world_requests
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.compute_thread import compute_thread
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve.verifier import VerifierEngine, VerifierError
from specula.targets import load_target


TARGET_CALLS = ("prefill", "verify", "decode_step", "commit", "release")
DRAFTER_CALLS = ("begin", "propose", "observe", "extend", "observe_ahead", "release")


class ThreadRecorder:
    """A target or drafter that records which thread each of its ``calls`` ran on."""

    def __init__(self, inner, calls=TARGET_CALLS) -> None:
        self.inner, self.names = inner, calls
        self.threads: set[str] = set()
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.names:
            return attr

        def recorded(*a, **kw):
            self.threads.add(threading.current_thread().name)
            self.calls += 1
            return attr(*a, **kw)

        return recorded


def test_every_target_call_runs_on_the_compute_thread_and_the_answer_is_plain(model_dir, processor):
    req = world_requests(processor, 1, SamplingParams(max_tokens=12), start=2)[0]
    want = SpecEngine(load_target(model_dir), None).generate([req])[req.request_id].tokens
    target = ThreadRecorder(load_target(model_dir))
    from specula.drafters import create

    engine = VerifierEngine(target, create({"kind": "ngram", "max_n": 3}), gamma=4)
    try:
        got = engine.generate(req)
    finally:
        engine.close()
    assert got["tokens"] == list(want)
    assert target.calls > 3 and target.threads == {"specula-compute"}


def test_a_caller_on_the_compute_thread_turns_it_itself(model_dir, processor):
    """A benchmark that runs on the compute thread (``specula bench``) drives a verifier from there: no deadlock,
    the same answer."""
    reqs = world_requests(processor, 2, SamplingParams(max_tokens=10), start=5)
    target = load_target(model_dir)
    want = SpecEngine(target, None).generate(reqs)
    from specula.drafters import create

    engine = VerifierEngine(target, create({"kind": "ngram", "max_n": 3}), gamma=4)
    try:
        got = compute_thread().call(lambda: [engine.generate(r)["tokens"] for r in reqs])
    finally:
        engine.close()
    assert got == [list(want[r.request_id].tokens) for r in reqs]


def test_from_config_loads_the_models_on_the_compute_thread(model_dir, monkeypatch):
    from specula.runtime.engine import factory

    where = {}
    load, make = factory.load_target_for, factory.make_drafter

    def load_target_for(*a, **kw):
        where["target"] = threading.current_thread().name
        return load(*a, **kw)

    def make_drafter(*a, **kw):
        where["drafter"] = threading.current_thread().name
        return make(*a, **kw)

    monkeypatch.setattr(factory, "load_target_for", load_target_for)
    monkeypatch.setattr(factory, "make_drafter", make_drafter)
    engine = VerifierEngine.from_config(make_config(model_dir, drafter={"colocate": True}))
    try:
        assert where == {"target": "specula-compute", "drafter": "specula-compute"}
        assert engine.local is not None
    finally:
        engine.close()


def test_a_drafter_replica_builds_and_runs_its_drafter_on_one_compute_thread(model_dir, processor, monkeypatch):
    from specula.runtime.dataplane import DrafterServer, RemoteDrafter
    from specula.runtime.engine import factory

    made = {}
    make = factory.make_drafter

    def make_drafter(*a, **kw):
        made["built_on"] = threading.current_thread().name
        made["drafter"] = ThreadRecorder(make(*a, **kw), DRAFTER_CALLS)
        return made["drafter"]

    monkeypatch.setattr(factory, "make_drafter", make_drafter)
    req = world_requests(processor, 1, SamplingParams(max_tokens=12), start=3)[0]
    target = load_target(model_dir)
    want = SpecEngine(target, None).generate([req])[req.request_id].tokens
    server = DrafterServer.from_config(make_config(model_dir))  # ngram, drafting ahead (overlap) on
    server.start()
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=target.info.vocab_size, propose_timeout_s=60.0),
                              gamma=4)
    try:
        got = verifier.generate(req, drafter_address=server.address)
    finally:
        verifier.close()
        server.stop(0)
    assert got["drafter"] == "ok" and got["tokens"] == list(want)
    assert made["built_on"] == "drafter-compute"
    assert made["drafter"].calls > 2 and made["drafter"].threads == {"drafter-compute"}
    assert not server.compute.is_alive()  # stopped with the server


def test_a_bug_in_the_step_fails_its_requests_and_the_thread_serves_others(model_dir, processor):
    reqs = world_requests(processor, 2, SamplingParams(max_tokens=6), start=4)
    broken = VerifierEngine(load_target(model_dir), None)

    def admit():
        raise KeyError("bug in admit")

    broken._admit = admit
    try:
        with pytest.raises(VerifierError, match="bug in admit"):
            broken.generate(reqs[0])
        with pytest.raises(VerifierError, match="verifier loop died"):
            broken.check_health()
        with pytest.raises(VerifierError):  # a request after the crash is refused, not left hanging
            broken.generate(reqs[1])
    finally:
        broken.close()
    healthy = VerifierEngine(load_target(model_dir), None)  # the same process's compute thread goes on
    try:
        assert len(healthy.generate(reqs[1])["tokens"]) == 6
        healthy.check_health()
        assert compute_thread().is_alive()
    finally:
        healthy.close()


def test_a_vision_replica_loads_and_encodes_on_the_compute_thread(model_dir, processor):
    import asyncio

    from specula.runtime.serve.deployments import VisionEncoder
    from specula.runtime.serve.vision import VisionEngine

    threads = []

    class Recording(VisionEngine):
        @classmethod
        def from_config(cls, config):
            threads.append(threading.current_thread().name)
            return super().from_config(config)

        def encode_many(self, items):
            threads.append(threading.current_thread().name)
            return super().encode_many(items)

    req = world_requests(processor, 1, SamplingParams(max_tokens=4), start=0)[0]  # a caption: one image
    encoder = VisionEncoder.func_or_class(make_config(model_dir), engine_cls=Recording)
    want = VisionEngine.from_config(make_config(model_dir)).encode(req.pixel_values)

    batched = VisionEncoder.func_or_class._batched.__wrapped__  # the batch's body, without Serve's replica context
    got = asyncio.run(batched(encoder, [(req.pixel_values, None)]))[0]
    assert threads == ["specula-compute", "specula-compute"]
    assert torch.equal(got.features, want.features)
