"""The ``specula bench report`` flags, in a module that imports nothing heavy (the CLI builds its parser eagerly)."""

from __future__ import annotations

# the report's sections, in run order (runtime/bench/report/run.py maps each to its function)
SECTION_NAMES = ("main", "temperature", "gamma", "multi_image", "concurrency", "hf", "target", "wire", "overlap",
                 "served")


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="fewer prompts and points (<= 10 min on 2 cores)")
    p.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    p.add_argument("--drafters", nargs="+", default=None, metavar="DRAFTER",
                   help='drafter kinds or JSON configs (default: every available kind, chain + tree), e.g. '
                        '--drafters ngram \'{"kind": "random", "peaked": 2.0}\'')
    p.add_argument("--suite", action="append", default=[],
                   help="evaluation suite of the main section, repeatable (default: all)")
    p.add_argument("--n", dest="n_per_suite", type=int, default=None, help="main-section prompts per suite")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt at most")
    p.add_argument("--gamma", type=int, default=None, help="draft length outside the gamma sweep (default: 5)")
    p.add_argument("--skip", action="append", default=[], choices=list(SECTION_NAMES), help="a section not to run")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="output directory (default: reports/<date>-<machine>)")
    p.add_argument("--reliability", action="store_true",
                   help="also run the reliability and security suite (pytest tests/reliability, the fault and "
                        "no-pickle tests; needs the checkout) and collect each test's figure; off by default")
    p.add_argument("--reliability-timeout", dest="reliability_timeout_s", type=float, default=None, metavar="S",
                   help="seconds the reliability suite may take before it is killed (default: 3600)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
