"""What speculation can reach at most on this machine, from one run's own time split (``bench served``, the
report's served section): ceilings a measured speedup is read against.

Speculation only makes the decode phase cheaper. The prefill (the vision tower and the target's forward over the
prompt) is the same work with or without a drafter, so from the split (ms per generated token, booked by the
engine) of plain decoding ``P = P.prefill + P.decode`` and of the default config ``D = D.prefill + D.decode``:

- **free decoding**: had drafting and verifying cost nothing, the default would run at ``P / D.prefill`` of plain;
  a wanted speedup ``x`` needs the decode phase ``P.decode / (P / x - D.prefill)`` times faster than plain's (out of
  reach when ``P / x <= D.prefill``), against ``P.decode / D.decode`` measured.
- **more streams**: ``k`` streams at once can give at most ``D1 / Dk.prefill`` of one stream's tokens/s (a prefill
  costs what it costs whether or not it is batched: compute-bound), with the same "needed" reading.
- **nothing to draft**: a suite whose answers run at most two tokens gains nothing: the prefill gives the first
  token, and the second takes one forward of the target whatever is drafted. Its ceiling is 1.00x.

Figures are ratios of booked engine time; tokens/s at the client also pay what happens outside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from specula.runtime.engine.metrics import TIME_KEYS

PREFILL_KEYS = ("vision", "prefill")
DECODE_KEYS = tuple(k for k in TIME_KEYS if k not in PREFILL_KEYS)  # every other phase the engine books
NOTHING_TO_DRAFT_TOKENS = 2  # answers this short: the prefill's token, then one forward


@dataclass(frozen=True)
class Phases:
    """ms per generated token: the prefill's share and the decode phase's."""

    prefill: float
    decode: float

    @property
    def total(self) -> float:
        return self.prefill + self.decode

    @classmethod
    def of(cls, ms_per_token: dict) -> Phases:
        return cls(sum(ms_per_token.get(k) or 0.0 for k in PREFILL_KEYS),
                   sum(ms_per_token.get(k) or 0.0 for k in DECODE_KEYS))


@dataclass(frozen=True)
class Ceiling:
    """``base`` -> ``faster``: the booked speedup, its cap with free decoding, the decode phase's measured speedup
    and the one ``want`` needs (None: out of reach, the prefill alone costs more)."""

    runtime: str
    compared: str
    booked: float
    cap: float
    decode_x: float | None
    want: float
    needed_decode_x: float | None

    def to_dict(self) -> dict:
        return {"runtime": self.runtime, "compared": self.compared, "booked": round(self.booked, 3),
                "cap": round(self.cap, 3), "decode_x": None if self.decode_x is None else round(self.decode_x, 3),
                "want": self.want,
                "needed_decode_x": None if self.needed_decode_x is None else round(self.needed_decode_x, 3)}


def ceiling(runtime: str, compared: str, base: Phases, faster: Phases, want: float) -> Ceiling | None:
    """``faster`` over ``base`` (ms per token each); None without a prefill to bound it."""
    if faster.prefill <= 0 or base.total <= 0:
        return None
    budget = base.total / want - faster.prefill  # what the decode phase may cost per token for ``want``
    return Ceiling(runtime, compared, base.total / max(faster.total, 1e-12), base.total / faster.prefill,
                   base.decode / faster.decode if faster.decode > 0 else None, want,
                   base.decode / budget if budget > 0 and base.decode > 0 else None)


def ceilings(rows: dict, want_over_plain: float = 1.5, want_streams: float = 2.5) -> list[Ceiling]:
    """From ``bench served``'s rows (``"runtime/config/streams"`` -> row with ``ms_per_token``): per runtime, the
    default over plain at one stream, and the default at each larger stream count over its one stream."""
    out = []
    for runtime in ("in_process", "served"):
        one, plain = rows.get(f"{runtime}/default/1"), rows.get(f"{runtime}/plain/1")
        if one is None:
            continue
        d1 = Phases.of(one["ms_per_token"])
        if plain is not None and (c := ceiling(runtime, "default over plain, 1 stream",
                                               Phases.of(plain["ms_per_token"]), d1, want_over_plain)):
            out.append(c)
        many = sorted(int(k.split("/")[2]) for k in rows if k.startswith(f"{runtime}/default/") and
                      int(k.split("/")[2]) > 1)
        for k in many:
            dk = Phases.of(rows[f"{runtime}/default/{k}"]["ms_per_token"])
            if c := ceiling(runtime, f"default, {k} streams over 1", d1, dk, want_streams):
                out.append(c)
    return out


def nothing_to_draft(answer_tokens: dict[str, int]) -> list[str]:
    """The suites whose longest answer is at most two tokens (``answer_tokens``: suite -> longest answer)."""
    return [s for s, n in answer_tokens.items() if 0 < n <= NOTHING_TO_DRAFT_TOKENS]


def _x(v: float | None, out_of_reach: str = "out of reach") -> str:
    return out_of_reach if v is None else f"{v:.2f}x"


def ceilings_md(rows: dict, answer_tokens: dict[str, int] | None = None) -> list[str]:
    """Markdown: the ceilings table and the suites with nothing to draft."""
    cs = ceilings(rows)
    if not cs:
        return []
    lines = ["What speculation could reach here at most, from the time split above (booked engine time): the "
             "prefill is the same work with or without a drafter, so even free drafting and verifying leave it. "
             "\"Needed\" is the decode phase's speedup the wanted figure takes (out of reach: the prefill alone "
             "costs more).", "",
             "| runtime | compared | booked | cap (free decoding) | decode phase, measured | wanted | "
             "decode phase, needed |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in cs:
        lines.append(f"| {c.runtime} | {c.compared} | {c.booked:.2f}x | {c.cap:.2f}x | {_x(c.decode_x, '-')} | "
                     f"{c.want:.1f}x | {_x(c.needed_decode_x)} |")
    none = nothing_to_draft(answer_tokens or {})
    if none:
        lines += ["", f"Nothing to draft in {', '.join(none)}: every answer there runs at most "
                      f"{NOTHING_TO_DRAFT_TOKENS} tokens (the prefill gives the first, the second takes one forward "
                      "whatever is drafted), so 1.00x is their ceiling."]
    return lines
