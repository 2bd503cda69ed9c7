"""When the in-batch ensemble's other members join a request (option ``join``).

IbED drafts every member from the first block (``join: "at_once"``). Each member row costs a prefill of its own
context (a caption member first captions every image) and a row in every draft forward, and on a request where
the first member already drafts well the mixture only dilutes it: on the embedded target, greedy, the multimodal
member alone accepted as much as the four-member mixture or more on every suite (docs/drafters.md). So by default
(``join: "on_demand"``) the first listed member drafts alone, and the others join a request once that member has
shown it drafts poorly there:

    blocks >= join_after  and  accepted / examined < join_below

over the request's verified blocks so far (accepted: the draft tokens the target kept; examined: those plus, per
block, the draft position it turned down, if it turned one down: a rate per examined draft position, the same at
any gamma, adaptive or not), for sampled requests: a greedy one keeps its first member alone unless
``join_greedy`` is set. Measured on the embedded target (reports/2026-12-07e-ensemble-join-linux-x86_64-2c/):
sampled at T = 1 the joined mixture raised tau where the multimodal member struggled (reasoning 2.76 -> 3.22),
while for greedy requests the mixture's argmax lowered it (reasoning 4.24 -> 3.89) and joining only cost time.

They join with the request's committed tokens as their context's tail (fed at their next forward), their caption
made then, and the mixture's weights start from the configured prior. What joins depends only on verified blocks, and every draft is drawn from the mixture of the members live at that
moment, which is the q the verifier gets: the output stays exactly the target's.

    rule = JoinRule.parse("on_demand", join_after=2, join_below=0.7, join_greedy=False, where="ensemble")
    rule.waits(temperature=0.8)                               # True: a sampled request's others wait
    rule.due(JoinStats(blocks=3, accepted=4, examined=7))  # True: 0.57 < 0.7
"""

from __future__ import annotations

from dataclasses import dataclass

JOIN_MODES = ("on_demand", "at_once")


@dataclass
class JoinStats:
    """One request's verified blocks while its other members wait."""

    blocks: int = 0
    accepted: int = 0
    examined: int = 0

    def add(self, accepted: int, missed: bool) -> None:
        """One verified block: ``accepted`` draft tokens kept, ``missed`` whether a draft position was turned down."""
        self.blocks += 1
        self.accepted += int(accepted)
        self.examined += int(accepted) + int(missed)


@dataclass(frozen=True)
class JoinRule:
    at_once: bool
    after: int  # blocks seen before the first member is judged
    below: float  # acceptance rate under which the others join
    greedy: bool = False  # whether greedy requests may call the others in

    @classmethod
    def parse(cls, join, join_after, join_below, join_greedy, where: str) -> JoinRule:
        if join not in JOIN_MODES:
            raise ValueError(f"{where}: join must be one of {JOIN_MODES}, got {join!r}")
        if isinstance(join_after, bool) or not isinstance(join_after, int) or join_after < 1:
            raise ValueError(f"{where}: join_after must be an integer >= 1, got {join_after!r}")
        if isinstance(join_below, bool) or not isinstance(join_below, (int, float)) or not 0 <= join_below <= 1:
            raise ValueError(f"{where}: join_below must be a number in [0, 1], got {join_below!r}")
        if not isinstance(join_greedy, bool):
            raise ValueError(f"{where}: join_greedy must be true or false, got {join_greedy!r}")
        return cls(join == "at_once", int(join_after), float(join_below), join_greedy)

    def waits(self, temperature: float) -> bool:
        """Whether a request at this temperature starts with its first member alone and may call the others in
        (False: it drafts with every member from the start, ``at_once``, or with the first one for good)."""
        return not self.at_once and (self.greedy or temperature > 0)

    def due(self, stats: JoinStats) -> bool:
        """Whether the waiting members join now (never for ``at_once``: they were there from the start)."""
        if self.at_once or stats.blocks < self.after or stats.examined == 0:
            return False
        return stats.accepted < self.below * stats.examined
