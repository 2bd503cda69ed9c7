"""``GET /metrics``: one ingress replica's counters in the Prometheus text format (0.0.4), written by hand (a few
counters, gauges and two histograms need no client library, and nothing here is process-global).

What is counted (every front door feeds the same ``ServeMetrics``; names follow vLLM's spec-decode metrics)::

    specula_requests_total{route, code}                requests answered, by route and status (HTTP code or gRPC name)
    specula_stream_errors_total{route, code}           streams that started (200) and then ended in an error event
                                                       (408: request_timeout_s passed; 500: the target failed)
    specula_requests_running / specula_requests_queued admission now: generations running / waiting for a slot
    specula_generations_total{reason}                  generations ended: eos, stop, length, cancelled, error, timeout
    specula_prompt_tokens_total, specula_generation_tokens_total
    specula_spec_verifications_total                   target verifications after prefill (plain decode steps too)
    specula_spec_drafts_total                          verifications that had at least one draft token
    specula_spec_draft_tokens_total, specula_spec_accepted_tokens_total
    specula_spec_drafted_per_position_total{position}  drafts that reached position n (1-based)
    specula_spec_accepted_per_position_total{position} drafts whose position n was accepted (alpha_n = ratio)
    specula_spec_tau                                   tokens per verification, bonus included, over all finished
    specula_drafter_fallbacks_total                    requests that decoded alone because the drafter failed
    specula_time_seconds_total{phase}                  the verifier's split (prefill, draft, verify, sample, commit,
                                                       vision) and the ingress's: queue (admission wait), prepare
                                                       (images + tokens), transfer (the rest of a generation's wall
                                                       time: Ray hops, vision encoding, waiting in the verifier)
    specula_request_duration_seconds (histogram), specula_time_to_first_token_seconds (histogram)

Generations that end on a stop string are cancelled at the verifier before it reports, so their spec metrics are
not counted (their tokens are). Counters are per replica: with several ingress replicas scrape each (Prometheus
sees whichever replica Serve routes the scrape to), or keep one ingress replica.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Family:
    def __init__(self, name: str, kind: str, help_: str) -> None:
        self.name, self.kind, self.help = name, kind, help_
        self.values: dict[tuple, float] = defaultdict(float)  # sorted label items -> value

    def inc(self, amount: float = 1.0, **labels) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        out += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return out


class _Histogram:
    def __init__(self, name: str, help_: str, buckets=_LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {_num(self.sum)}",
                f"{self.name}_count {self.count}"]
        return out


class ServeMetrics:
    """The counters of one ingress replica. Not thread-safe: call from the replica's event loop.

    Args:
        admission: the replica's ``Admission`` (running / queued are read from it at scrape time), or None.
    """

    def __init__(self, admission=None) -> None:
        self.admission = admission
        f = _Family
        self.requests = f("specula_requests_total", "counter", "Requests answered, by route and status.")
        self.stream_errors = f("specula_stream_errors_total", "counter",
                               "Streams that started and then ended in an error event, by route and status.")
        self.generations = f("specula_generations_total", "counter", "Generations ended, by reason.")
        self.prompt_tokens = f("specula_prompt_tokens_total", "counter", "Prompt tokens of finished generations.")
        self.gen_tokens = f("specula_generation_tokens_total", "counter", "Tokens generated.")
        self.verifications = f("specula_spec_verifications_total", "counter",
                               "Target verifications after prefill (plain decode steps included).")
        self.drafts = f("specula_spec_drafts_total", "counter", "Verifications with at least one draft token.")
        self.draft_tokens = f("specula_spec_draft_tokens_total", "counter", "Draft tokens sent to the verifier.")
        self.accepted = f("specula_spec_accepted_tokens_total", "counter", "Draft tokens accepted.")
        self.drafted_pos = f("specula_spec_drafted_per_position_total", "counter",
                             "Verifications whose draft reached position n (1-based).")
        self.accepted_pos = f("specula_spec_accepted_per_position_total", "counter",
                              "Verifications whose draft token at position n was accepted.")
        self.fallbacks = f("specula_drafter_fallbacks_total", "counter",
                           "Generations that decoded alone because the drafter failed or was slow.")
        self.time = f("specula_time_seconds_total", "counter", "Seconds spent, by phase.")
        self.duration = _Histogram("specula_request_duration_seconds", "Wall time of a generation (admitted).")
        self.ttft = _Histogram("specula_time_to_first_token_seconds", "Admission to the first token.")

    # ------------------------------------------------------------------------------------------- recording

    def request(self, route: str, code: int | str) -> None:
        """A request answered (its status; for a stream, the status it started with)."""
        self.requests.inc(route=route, code=str(code))

    def stream_error(self, route: str, code: int | str) -> None:
        """A stream that had started ended in an error event instead of its last chunk."""
        self.stream_errors.inc(route=route, code=str(code))

    def phase(self, phase: str, seconds: float) -> None:
        self.time.inc(max(seconds, 0.0), phase=phase)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generation_ended(self, reason: str, prompt_tokens: int, completion_tokens: int, wall_s: float,
                         chunk: dict | None = None) -> None:
        """A generation is over; ``chunk`` is the verifier's finished chunk when there is one (its "metrics")."""
        self.generations.inc(reason=reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.gen_tokens.inc(completion_tokens)
        self.duration.observe(wall_s)
        m = (chunk or {}).get("metrics")
        if str((chunk or {}).get("drafter") or "").startswith("fallback"):
            self.fallbacks.inc()
        if not m:
            return
        self.verifications.inc(m.get("blocks", 0))
        self.draft_tokens.inc(m.get("draft_tokens", 0))
        self.accepted.inc(m.get("accepted_tokens", 0))
        drafted, accepted = _per_position(m)
        if drafted:
            self.drafts.inc(drafted[0])
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            self.drafted_pos.inc(d, position=str(i + 1))
            self.accepted_pos.inc(a, position=str(i + 1))
        spent = 0.0
        for k, v in (m.get("time_s") or {}).items():
            self.phase(k, v)
            spent += v
        self.phase("transfer", wall_s - spent)

    # ------------------------------------------------------------------------------------------- exposition

    def render(self) -> str:
        lines: list[str] = []
        for fam in (self.requests, self.stream_errors, self.generations, self.prompt_tokens, self.gen_tokens, self.verifications,
                    self.drafts, self.draft_tokens, self.accepted, self.drafted_pos, self.accepted_pos,
                    self.fallbacks, self.time):
            lines += fam.lines()
        blocks = sum(self.verifications.values.values())
        tau = (sum(self.accepted.values.values()) + blocks) / blocks if blocks else 0.0
        running = self.admission.running if self.admission is not None else 0
        queued = self.admission.queued if self.admission is not None else 0
        for name, help_, v in (
                ("specula_spec_tau", "Tokens per verification (accepted drafts + 1), over finished generations.", tau),
                ("specula_requests_running", "Generations running in this replica now.", running),
                ("specula_requests_queued", "Generations waiting for an admission slot now.", queued)):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {_num(v)}"]
        lines += self.duration.lines() + self.ttft.lines()
        return "\n".join(lines) + "\n"


class GenerationMeter:
    """One generation's bookkeeping for ``ServeMetrics``: feed it every verifier chunk, and ``end`` it when the
    stream stops early; the first end wins (a finished chunk ends it with its own reason)::

        meter = GenerationMeter(metrics, prompt_tokens=161)
        try:
            async for chunk in verifier_chunks:
                meter.add(chunk)
                ...
        except Exception:
            meter.end("error"); raise
        finally:
            meter.end("closed_early")   # the caller stopped reading: a stop string, a disconnect, a deadline
    """

    def __init__(self, metrics: ServeMetrics, prompt_tokens: int) -> None:
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.first = True
        self.finished = False  # the verifier finished the request (nothing left to cancel)
        self.ended = False

    def add(self, chunk: dict) -> None:
        if self.first:
            self.metrics.first_token(time.perf_counter() - self.t0)
            self.first = False
        self.tokens += len(chunk["tokens"])
        if chunk["finished"]:
            self.finished = True
            self._end(chunk["finish_reason"] or "unknown", chunk)

    def end(self, reason: str) -> None:
        self._end(reason, None)

    def _end(self, reason: str, chunk: dict | None) -> None:
        if not self.ended:
            self.ended = True
            self.metrics.generation_ended(reason, self.prompt_tokens, self.tokens, time.perf_counter() - self.t0,
                                          chunk)


def _per_position(m: dict) -> tuple[list[int], list[int]]:
    """Per-position drafted / accepted counts of one request's metrics dict (``RequestMetrics.to_dict``)."""
    return list(m.get("drafted_at") or []), list(m.get("accepted_at") or [])


def _labels(items: tuple) -> str:
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in items)
    return "{" + body + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return "+Inf" if v > 0 else ("-Inf" if v < 0 else "NaN")
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))
