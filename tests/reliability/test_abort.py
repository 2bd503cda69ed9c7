"""Abort: 100 concurrent requests, 10 of them aborted mid-generation through each way the serving stack offers
(a gRPC client cancelling its stream, a client closing its /generate stream, the verifier's own ``cancel``); the
other 90 complete exactly as they do alone, and the verifier's KV memory returns to baseline.

The stack: ``LocalApp`` (ingress, vision engine, ``VerifierEngine`` batching up to 32 live requests, the text_lm
drafter in a ``DrafterServer`` on loopback gRPC, drafting ahead as deployed) plus the public gRPC API (a real
grpc.aio server) over the same engines. The 90 arrive through gRPC GenerateStream, gRPC Generate and /generate,
greedy (exact whatever the batch and the draft-ahead timing); "alone" is the same request run by itself.

The victims ask for 256 tokens (at most gamma + 1 = 4 per step, so >= 64 steps) and are aborted right after
their first chunk. The verifier's view (its ``submit`` is wrapped to watch every request's last chunk) shows each
ended "cancelled" well short of 256 tokens, so it was stopped, not run to the end. KV memory: the bytes of K/V
storage the target's batched cache holds (``kv_bytes``) and the text_lm drafter's own cache, at baseline (idle),
at peak (sampled before every verification) and after; plus live rows, request ids, drafter sessions.
"""

from __future__ import annotations

import base64
import threading
import uuid

import grpc
import pytest

from specula.runtime.api_client import SpeculaClient, request as grpc_request
from specula.runtime.serve import LocalApp

from reliability_kit import record_figure, scale
from reliability_serving import (EventLoopThread, build_weights, drafter_options, kv_bytes, make_config,
                                 run_threads, serve_grpc, wait_until, world_body)

pytestmark = pytest.mark.integration
TOTAL, ABORTED = scale(100, 400), scale(10, 40)
VICTIM_TOKENS = 256
POOL = 15  # distinct requests among the survivors (each also run alone once)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = build_weights(tmp_path_factory)
    drafter = {**drafter_options("text_lm", root), "overlap": True}  # as deployed: draft the next block ahead
    cfg = make_config(root / "target", drafter,
                      limits={"max_tokens": VICTIM_TOKENS, "max_images": 5, "max_concurrent_requests": 512,
                              "max_queued_requests": 512},
                      deployments={"target_verifier": {"max_batch_size": 32}})
    app = LocalApp.from_config(cfg)
    loop = EventLoopThread()
    _, server = serve_grpc(loop, cfg, app)
    watch = _Watch(app)
    client = SpeculaClient(f"127.0.0.1:{server.port}", timeout=300)
    try:
        yield app, client, watch
    finally:
        client.close()
        loop.call(server.stop(grace=1.0))
        loop.close()
        app.close()


class _Watch:
    """What the verifier saw: each request's last chunk (reason, tokens, max_tokens), and the peak KV bytes."""

    def __init__(self, app: LocalApp) -> None:
        self.app, self.lock = app, threading.Lock()
        self.ends: dict[str, tuple[str, int, int]] = {}
        self.peak_target = self.peak_drafter = self.widest = 0
        self.drafter_len = self.drafter_valid = 0  # the drafter cache's longest length, its longest row's slots
        verifier, target = app.verifier, app.verifier.target
        submit, verify = verifier.submit, target.verify

        def watched_submit(request, sink, drafter_address=None):
            count = [0]

            def recording(item):
                if isinstance(item, dict):
                    count[0] += len(item["tokens"])
                    if item["finished"]:
                        with self.lock:
                            self.ends[request.request_id] = (item["finish_reason"], count[0],
                                                             request.params.max_tokens)
                else:
                    with self.lock:
                        self.ends[request.request_id] = (f"error: {item!r}", count[0], request.params.max_tokens)
                sink(item)

            return submit(request, recording, drafter_address)

        def watched_verify(block):  # on the verifier's loop thread
            self.peak_target = max(self.peak_target, kv_bytes(target.kv))
            self.peak_drafter = max(self.peak_drafter, self.drafter_kv())
            valid = app.drafter.drafter._kv.valid  # noqa: SLF001 - [B, S] bool, read from this thread
            if valid is not None:
                self.drafter_len = max(self.drafter_len, valid.shape[1])
                self.drafter_valid = max(self.drafter_valid, int(valid.sum(1).max()))
            self.widest = max(self.widest, len(block.request_ids))
            return verify(block)

        verifier.submit, target.verify = watched_submit, watched_verify

    def drafter_kv(self) -> int:
        return kv_bytes(self.app.drafter.drafter._kv)  # noqa: SLF001 - the text_lm drafter's batched cache

    def idle(self) -> bool:
        """No request anywhere: no verifier row, KV row, request id or sink; no drafter session or row."""
        v, d = self.app.verifier, self.app.drafter
        return (not v.engine.rows and not v.target.live_ids and not v._ids and not v._sinks  # noqa: SLF001
                and not v.remote._streams and d.live_sessions == 0 and not d.drafter._rows)  # noqa: SLF001


def _pool_body(i: int) -> dict:
    return world_body(i % POOL, max_tokens=10 + 2 * (i % 5))


def _survivor(app: LocalApp, client: SpeculaClient, i: int) -> dict:
    body = _pool_body(i)
    door = ("grpc_stream", "grpc_unary", "generate")[i % 3]
    if door == "generate":
        r = app.generate(body)
        return {"tokens": r["tokens"], "text": r["text"], "finish": r["finish_reason"]}
    prompt, images = body["prompt"], [base64.b64decode(s) for s in body["images"]]
    if door == "grpc_unary":
        r = client.generate(prompt, images, max_tokens=body["max_tokens"])
        return {"tokens": r.tokens, "text": r.text, "finish": r.finish_reason}
    chunks = list(client.stream(prompt, images, max_tokens=body["max_tokens"]))
    assert chunks[-1].finished
    return {"tokens": [t for c in chunks for t in c.tokens], "text": "".join(c.text for c in chunks),
            "finish": chunks[-1].finish_reason}


def _victim(app: LocalApp, client: SpeculaClient, j: int) -> str:
    """Start a long request, wait for its first tokens, abort it; returns how it was aborted."""
    body = world_body(j % 6, max_tokens=VICTIM_TOKENS)
    how = ("grpc_cancel", "stream_closed", "verifier_cancel")[j % 3]
    if how == "grpc_cancel":  # the client leaves: the handler is cancelled, which closes the verifier stream
        images = [base64.b64decode(s) for s in body["images"]]
        call = client.stub.GenerateStream(grpc_request(body["prompt"], images, max_tokens=VICTIM_TOKENS),
                                          timeout=300)
        first = next(call)
        assert first.tokens and not first.finished
        call.cancel()
        assert call.code() == grpc.StatusCode.CANCELLED
    elif how == "stream_closed":  # /generate's NDJSON stream closed early (an HTTP client disconnecting)
        records = app.stream({**body, "stream": True})
        first = next(records)
        assert first["tokens"] and not first.get("finished")
        records.close()
    else:  # the verifier's cancel API, by request id; the stream then ends with a "cancelled" chunk
        rid = uuid.uuid4().hex
        chunks = app.run(app.ingress.prepare(app.ingress.parse(body), rid))
        first = next(chunks)
        assert first["tokens"] and not first["finished"]
        app.verifier.cancel(rid)
        rest = list(chunks)
        assert rest and rest[-1]["finished"] and rest[-1]["finish_reason"] == "cancelled", rest[-1:]
    return how


def test_aborting_ten_of_a_hundred_leaves_the_rest_identical_and_frees_kv(stack):
    app, client, watch = stack
    alone = {i: app.generate(_pool_body(i)) for i in range(POOL)}
    wait_until("idle after the solo runs", watch.idle)
    base_target, base_drafter = kv_bytes(app.verifier.target.kv), watch.drafter_kv()
    watch.ends.clear()
    watch.peak_target = watch.peak_drafter = watch.widest = watch.drafter_len = watch.drafter_valid = 0

    victims = set(range(0, TOTAL, TOTAL // ABORTED))  # spread over the arrival order
    jobs = [(lambda j=j: _victim(app, client, j)) if j in victims else (lambda j=j: _survivor(app, client, j))
            for j in range(TOTAL)]
    got = run_threads(jobs, bound_s=600)

    for j, g in enumerate(got):
        assert not isinstance(g, BaseException), (j, g)
        if j in victims:
            continue
        want = alone[j % POOL]
        assert g["tokens"] == want["tokens"] and g["text"] == want["text"], j
        assert g["finish"] == want["finish_reason"] in ("length", "eos"), (j, g["finish"])
    wait_until("every request gone from the verifier and the drafter", watch.idle)

    ends = dict(watch.ends)
    long_ones = [e for e in ends.values() if e[2] == VICTIM_TOKENS]
    assert len(long_ones) == len(victims), ends
    assert all(reason == "cancelled" and n < VICTIM_TOKENS for reason, n, _ in long_ones), long_ones
    others = [e for e in ends.values() if e[2] != VICTIM_TOKENS]
    assert len(others) == TOTAL - len(victims) and all(r in ("length", "eos") for r, _, _ in others), others
    after_target, after_drafter = kv_bytes(app.verifier.target.kv), watch.drafter_kv()
    assert watch.widest >= 2 and watch.peak_target > base_target  # they ran together, their KV was held
    assert (after_target, after_drafter) == (base_target, base_drafter) == (0, 0)
    # while sessions draft ahead the drafter's cache is still compacted: holes < max(64, S / 4) (KVPolicy), plus
    # what one verifier step's calls add before the first verdict (per session a proposal and its draft-ahead,
    # <= 2 * gamma + 3 columns); it once grew without bound, every call slower than the last
    per_step = watch.widest * (2 * app.verifier.engine.gamma + 3)
    assert watch.drafter_len <= 4 / 3 * (watch.drafter_valid + per_step) + 64, (watch.drafter_len, watch.drafter_valid)

    hows = [got[j] for j in sorted(victims)]
    cut = sorted(n for _, n, _ in long_ones)
    record_figure(
        "test_aborting_ten_of_a_hundred_leaves_the_rest_identical_and_frees_kv",
        f"{TOTAL - len(victims)}/{TOTAL - len(victims)} survivors identical to their solo runs; "
        f"{len(victims)}/{len(victims)} aborted mid-generation ({hows.count('grpc_cancel')} gRPC cancel, "
        f"{hows.count('stream_closed')} stream closed, {hows.count('verifier_cancel')} verifier cancel; "
        f"stopped after {cut[0]}-{cut[-1]} of {VICTIM_TOKENS} tokens); target KV {base_target} B -> peak "
        f"{watch.peak_target / 2**20:.2f} MiB (batch {watch.widest}) -> {after_target} B, drafter KV "
        f"{base_drafter} B -> peak {watch.peak_drafter / 2**20:.2f} MiB (length {watch.drafter_len}, longest row "
        f"{watch.drafter_valid}) -> {after_drafter} B; 0 live requests, "
        f"0 drafter sessions",
        survivors=TOTAL - len(victims), survivors_identical=TOTAL - len(victims), aborted=len(victims),
        grpc_cancel=hows.count("grpc_cancel"), stream_closed=hows.count("stream_closed"),
        verifier_cancel=hows.count("verifier_cancel"), stopped_after_min=cut[0], stopped_after_max=cut[-1],
        victim_tokens=VICTIM_TOKENS, target_kv_base_b=base_target, target_kv_peak_b=watch.peak_target,
        target_kv_after_b=after_target, widest_batch=watch.widest, drafter_kv_base_b=base_drafter,
        drafter_kv_peak_b=watch.peak_drafter, drafter_kv_after_b=after_drafter)
