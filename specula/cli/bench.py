"""``specula bench target | spec | report | distributed | outcomes | reference | served``: the benchmarks (runtime/bench/).

``report``, ``distributed``, ``outcomes`` and ``reference`` define their flags beside their code
(``add_arguments``), mounted here; ``target`` and ``spec`` import torch at the top of their modules, so their flags
are here and their code is imported only when they run.
"""

from __future__ import annotations

import functools

from specula.cli.common import set_threads
from specula.runtime.bench.distributed import add_arguments as distributed_arguments
from specula.runtime.bench.outcomes import add_arguments as outcomes_arguments
from specula.runtime.bench.reference import add_arguments as reference_arguments
from specula.runtime.bench.served import add_arguments as served_arguments
from specula.runtime.bench.report.args import add_arguments as report_arguments


def register(sub) -> None:
    """Add ``bench`` and its commands to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("bench", help="benchmarks (JSON + markdown, ratios measured in one run)",
                       description="Measure the target's costs, speculative against plain decoding, every drafter "
                                   "side by side, the distributed runtime, or how far ahead a drafter could draft.")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    _add_target(bsub)
    _add_spec(bsub)
    rp = bsub.add_parser("report", help="every available drafter on every suite, side by side: JSON + markdown + "
                                         "PNG report in reports/<date>-<machine>/",
                         description="Runs the main table (tau and speedup per drafter x suite), alpha_n, gamma "
                                     "sweep, temperature 0 and 1, time split, multi-image scaling, throughput vs "
                                     "concurrency, HF generate / assisted, target costs, wire bytes per codec and "
                                     "the distributed overlap where available, then one line per seed paper's claim. "
                                     "A section that cannot run records why.")
    report_arguments(rp)
    rp.set_defaults(func=on_compute_thread(run_report))
    dp = bsub.add_parser("distributed", help="distributed runtime: pipelined (overlap) vs sequential vs single "
                                             "process vs plain, drafter in its own process",
                         description="Drafter server and verifier in separate processes (one torch thread each, "
                                     "loopback gRPC); every configuration round robin on the same prompts; JSON + "
                                     "markdown with tau, speedups, overlap efficiency, time split and wire bytes.")
    distributed_arguments(dp)
    dp.set_defaults(func=on_compute_thread(run_distributed))
    op = bsub.add_parser("outcomes", help="how often a verdict's outcome is among the drafter's top predicted "
                                          "outcomes: the ceiling of drafting ahead (no timing)",
                         description="Greedy SpecEngine runs in which the drafter ranks its guess and its likeliest "
                                     "rejection outcomes before every verdict; JSON + markdown with the share of "
                                     "blocks covered by the top 1 .. m outcomes.")
    outcomes_arguments(op)
    op.set_defaults(func=on_compute_thread(run_outcomes))
    fp = bsub.add_parser("reference", help="the shipped target's plain greedy answers on a fixed prompt set (every "
                                           "suite), written to the file the tests check every runtime against",
                         description="Decodes the reference prompt set plainly (greedy, no drafter) and writes "
                                     "tests/data/reference_greedy.json; with --check, decodes the file's prompts "
                                     "again and prints a diff per prompt whose answer changed (exit 1 if any).")
    reference_arguments(fp)
    fp.set_defaults(func=on_compute_thread(run_reference))
    sv = bsub.add_parser("served", help="the served runtime (real Ray Serve, the openai client over HTTP) with the "
                                        "default drafter and with gamma 0, beside in-process decoding",
                         description="Starts `specula serve` with the config (default drafter) and with "
                                     "drafter.gamma 0, each on its own local Ray, and drives both over HTTP with the "
                                     "openai client (1 and 8 streams by default, every suite), round robin with "
                                     "in-process decoding of the same prompts, each runtime alone on the machine "
                                     "(the other servers stopped meanwhile); JSON + markdown with tokens/s, "
                                     "speedups, tau, the verifier's time split and answers checked against "
                                     "in-process plain decoding.")
    served_arguments(sv)
    sv.set_defaults(func=on_compute_thread(run_served))


def _add_target(bsub) -> None:
    t = bsub.add_parser("target", help="target costs: params, T_decode, T_verify(gamma)/T_decode, prefill, vision encode",
                        description="Parameters, decode step, verify step of gamma tokens against a decode step, "
                                    "prefill and vision encode of one target; JSON + markdown.")
    t.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    t.add_argument("--out", default="reports/bench-target", help="output directory for JSON + markdown")
    t.add_argument("--max-gamma", type=int, default=8, help="largest gamma measured (default: 8)")
    t.add_argument("--repeats", type=int, default=20, help="timed repeats per figure (median reported; default: 20)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(func=on_compute_thread(run_target))


def _add_spec(bsub) -> None:
    sp = bsub.add_parser("spec", help="speculative vs plain decoding (our engine, HF generate, HF assisted) per suite",
                         description="Runs every configuration round robin on the same prompts (the world's "
                                     "evaluation suites and/or your own, --prompts) and writes JSON, markdown and "
                                     "PNG plots (tau per suite, alpha_n, speedup vs gamma, one row per prompt).")
    sp.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    sp.add_argument("--drafter", action="append", default=[], metavar="KIND|DIR|JSON",
                    help='drafter kind, trained drafter directory (its specula.json record checked against --model) '
                         'or JSON config, repeatable (default: ngram), e.g. --drafter runs/eagle-llava or --drafter '
                         '\'{"kind": "ngram", "max_n": 3}\'; engine settings in the JSON: "adaptive": true (draft '
                         'length chosen per step), "begin_after": N (the drafter begins once an answer has N tokens), '
                         '"label"')
    sp.add_argument("--gamma", action="append", type=int, default=[], help="draft length, repeatable (default: 5)")
    sp.add_argument("--suite", action="append", default=[],
                    help="evaluation suite, repeatable (default: all of them, or none with --prompts)")
    sp.add_argument("--prompts", default=None, metavar="FILE",
                    help="your own prompts: a JSONL of {\"id\", \"prompt\", \"images\": [...], \"system\", "
                         "\"suite\"} records, or a LLaVA-Instruct / ShareGPT4V conversation file (each exchange one "
                         "prompt); rendered by the checkpoint's own chat template (docs/benchmarks.md)")
    sp.add_argument("--image-root", default=None, metavar="DIR",
                    help="where --prompts' relative image paths start (default: the file's folder)")
    sp.add_argument("--n", type=int, default=6,
                    help="prompts per suite: per world suite, and the first N of each suite label of --prompts "
                         "(default: 6)")
    sp.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most (default: 64)")
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sp.add_argument("--no-hf", action="store_true",
                    help="skip the HF generate / assisted baselines (the stock HF copy of the model is not loaded)")
    sp.add_argument("--out", default="reports/bench-spec", help="output directory (default: reports/bench-spec)")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the target's and the drafters' device "
                                                   "(default: cpu)")
    sp.set_defaults(func=on_compute_thread(run_spec))


def on_compute_thread(run):
    """``run`` on the process's compute thread (runtime/engine/compute_thread.py): every torch call of a
    benchmark's process on one thread, as in a serving replica. Two threads that both run torch's parallel kernels
    make OpenMP park and wake its workers at every region on a small machine, which would slow whichever engine
    the benchmark runs second, in-process baselines included."""

    @functools.wraps(run)
    def on_thread(args) -> int:
        from specula.runtime.engine.compute_thread import compute_thread

        return compute_thread().call(run, args)

    return on_thread


def run_target(args) -> int:
    set_threads(args)
    from specula.runtime.bench.target import main

    return main(args)


def run_spec(args) -> int:
    set_threads(args)
    from specula.runtime.bench.spec import main

    user = read_user_prompts(args.prompts, args.image_root) if args.prompts else None
    return main(args, user_prompts=user)


def read_user_prompts(path: str, image_root: str | None = None) -> list:
    """``--prompts FILE`` as ``UserPrompt``s (runtime/bench/prompt_file.py), the format told by its content: a
    conversation file (LLaVA-Instruct / ShareGPT4V) through the training data reader, one prompt per exchange (the
    turns before each answer), else a prompts file. Bad records: one ValueError naming each."""
    from specula.runtime.bench.prompt_file import DEFAULT_SUITE, UserPrompt, file_kind, read_prompts

    if file_kind(path) == "prompts":
        return read_prompts(path, image_root)
    from specula.training.data import DataError, exchanges, read_conversations

    try:
        convs = read_conversations(path, image_root, progress=False)  # every record checked, every image exists
    except DataError as e:
        shown = "\n".join(f"  {p}" for p in e.problems[:20])
        more = f"\n  ... and {e.n_problems - 20} more" if e.n_problems > 20 else ""
        head = f"{e.n_bad} bad record(s) in {path}" if e.n_bad else f"{path} is not a conversation file"
        raise ValueError(f"{head} (nothing was measured; the format: docs/training-data.md):\n{shown}{more}") from None
    out = []
    for conv in convs:
        for k, ex in enumerate(exchanges(conv)):
            where = f"{path}: record {conv.index}, id {conv.id!r}, exchange {k}"
            out.append(UserPrompt(f"{conv.id}/{k}", DEFAULT_SUITE, tuple(ex.messages), conv.images[: ex.n_images],
                                  where))
    if not out:
        raise ValueError(f"{path}: no exchange to prompt with")
    return out


def run_report(args) -> int:
    set_threads(args)
    from specula.runtime.bench.report.run import main

    return main(args)


def run_distributed(args) -> int:
    from specula.runtime.bench.distributed import main

    return main(args)


def run_outcomes(args) -> int:
    from specula.runtime.bench.outcomes import main

    return main(args)


def run_served(args) -> int:
    from specula.runtime.bench.served import main

    return main(args)


def run_reference(args) -> int:
    from specula.runtime.bench.reference import main

    return main(args)
