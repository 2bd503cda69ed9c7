"""``specula world sample | suites``: look at the embedded multimodal world."""

from __future__ import annotations


def register(sub) -> None:
    """Add ``world`` and its commands to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("world", help="look at the embedded multimodal world",
                       description="Write example samples of the world's suites as PNGs with their prompts and "
                                   "answers, or list the evaluation suites.")
    wsub = p.add_subparsers(dest="world_cmd", required=True)
    s = wsub.add_parser("sample", help="write example samples (PNGs + prompts/answers) so a person can look at them")
    s.add_argument("--suite", action="append", default=[], help="suite name (repeatable; default: all suites)")
    s.add_argument("--n", type=int, default=3, help="samples per suite (default: 3)")
    s.add_argument("--split", default="eval", choices=["train", "eval"], help="which split (default: eval)")
    s.add_argument("--out", default="world_samples", help="output directory (default: ./world_samples)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run_sample)
    ls = wsub.add_parser("suites", help="list the evaluation suites and what they mirror",
                         description="One line per evaluation suite of the world: its name, its task and the public "
                                     "benchmark it mirrors.")
    ls.set_defaults(func=run_suites)


def run_sample(args) -> int:
    from specula.world.show import write_samples

    path = write_samples(args.out, args.suite or None, args.n, args.split, args.seed)
    print(f"wrote {path}")
    return 0


def run_suites(args) -> int:
    from specula.world.suites import SUITES

    for s in SUITES.values():
        print(f"{s.name:12s} {s.task:10s} mirrors {s.mirrors}")
    return 0
