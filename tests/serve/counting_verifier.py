"""The shipped verifier engine with its data-plane counters in the answer, for tests of the distributed paths.

A request's last verifier chunk carries "dataplane" (``runtime/serve/verifier.py``: proposals, blocks drafted ahead
used / dropped, used for a rejection outcome, taken as Offers), but no API answer does. ``CountingVerifierEngine``
also copies those counters into ``metrics.time_s`` (prefixed "dataplane."), the one map HTTP, OpenAI and gRPC all
pass through unchanged, so a test can see that drafting ahead, predraft and offers really happened. Inject it with
``build_app(cfg, engine_classes={"target_verifier": CountingVerifierEngine})`` (after
``ray.cloudpickle.register_pickle_by_value(counting_verifier)``: tests/ is not on the replicas' import path) or
``local_app(cfg)`` (LocalApp, no Ray). Nothing else changes: the tokens are the shipped engine's.
"""

from __future__ import annotations

from specula.runtime.dataplane import DrafterServer
from specula.runtime.serve import LocalApp, VerifierEngine
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.vision import VisionEngine

PREFIX = "dataplane."
COUNTERS = ("proposals", "spec_used", "spec_dropped", "spec_branch", "offers_taken")


class CountingVerifierEngine(VerifierEngine):
    async def astream(self, request, drafter_address=None):
        async for chunk in super().astream(request, drafter_address=drafter_address):
            yield with_counters(chunk)

    def stream(self, request, drafter_address=None):
        for chunk in super().stream(request, drafter_address=drafter_address):
            yield with_counters(chunk)


def with_counters(chunk: dict) -> dict:
    dp, m = chunk.get("dataplane"), chunk.get("metrics")
    if dp and m:
        counts = {PREFIX + k: float(dp[k]) for k in COUNTERS}
        counts[PREFIX + "overlap"] = float(bool(dp["overlap"]))
        chunk = {**chunk, "metrics": {**m, "time_s": {**m.get("time_s", {}), **counts}}}
    return chunk


def counters(metrics: dict) -> dict[str, float]:
    """The data-plane counters of an answer's metrics (zeros where the request had no drafter session)."""
    t = metrics.get("time_s", {})
    return {k: t.get(PREFIX + k, 0.0) for k in (*COUNTERS, "overlap")}


def local_app(cfg) -> LocalApp:
    """LocalApp (ingress, vision, verifier here; the drafter in a DrafterServer on loopback gRPC) with the counting
    verifier. Close it."""
    drafter = DrafterServer.from_config(cfg)
    drafter.start()
    return LocalApp(IngressEngine.from_config(cfg), VisionEngine.from_config(cfg),
                    CountingVerifierEngine.from_config(cfg), drafter)
