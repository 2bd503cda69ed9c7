"""``python -m research <command>``: the probes and lane tools, out of the product's ``specula`` command.

    python -m research probe --n 100                     # where grounding fails: real vs oracle visual tokens
    python -m research probe-sets --checkpoint runs/X/ckpt  # image-set answers and every set hop, teacher-forced
    python -m research probe-content --model target      # where a set's colours and shapes survive, layer by layer
    python -m research probe-charts --n 30               # where the heads look at chart answers; words in the tokens
    python -m research lane save | restore               # a training lane kept in git as a small delta

Run from the repository root (research/ is not installed). The flags are the ones these commands had as
``specula zoo probe ...`` / ``specula zoo lane ...``; each handler imports its probe only when it runs.
"""

from __future__ import annotations

import argparse

from specula.cli.common import run_command, set_threads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m research",
        description="Research tools of Specula (not installed): probes of how a target reads its inputs, and "
                    "training lanes kept in git. Run `python -m research <command> --help` for each command.")
    sub = parser.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="where grounding fails: real vs oracle visual tokens vs the scene in words",
                         description="VQA accuracy per question type with the target's own visual tokens and with "
                                     "oracle ones (each object patch replaced by its words' embeddings), and the "
                                     "same questions about a scene described in words (see research/probe.py)")
    pr.add_argument("--model", default="target")
    pr.add_argument("--n", type=int, default=100, help="questions (default: 100)")
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.add_argument("--threads", type=int, default=2)

    pr.set_defaults(func=run_probe)
    ps = sub.add_parser("probe-sets", help="how a target reads image sets: answers and each set hop, teacher-forced",
                         description="Held-out image-set questions (which / odd one out / how many images / same "
                                     "shape), the answer fed in: per question type the first answer token's argmax "
                                     "over the type's candidate words, with the images and with gray ones, and the "
                                     "attention mass of every supervised set hop (reader, ordinal, mean and odd "
                                     "hops, summary and count hops) on its target and off it (see research/set_probe.py)")
    _probe_source(ps)
    ps.add_argument("--set-hops", default=None, choices=("deep", "shallow", "reader"),
                    help="the layers and heads of the set hops (default: the checkpoint's own, else reader)")
    ps.add_argument("--n", type=int, default=200, help="questions drawn (about a third of them each type; default 200)")
    _probe_output(ps, "probe_sets")

    ps.set_defaults(func=run_probe_sets)
    pc = sub.add_parser("probe-content", help="where an image set's colours and shapes survive, layer by layer",
                         description="Held-out image sets of the 'which image' questions: a ridge probe fitted on "
                                     "half the sets' object patches reads each patch's colour and shape from every "
                                     "decoder layer's input and is scored on the other half; for the set's first "
                                     "image, its later images, and every image in a prompt of its own (see "
                                     "research/content_probe.py). A later image that reads far below itself alone has "
                                     "been blended into the others.")
    _probe_source(pc)
    pc.add_argument("--n", type=int, default=60, help="image sets read (half to fit, half to score; default 60)")
    pc.add_argument("--isolate", action="store_true",
                    help="read the sets with each image's tokens kept off the other images and the text between "
                         "them (a 4-D attention mask): what the patches would hold if only the chat template came "
                         "before them, against what they hold")
    _probe_output(pc, "probe_content")

    pc.set_defaults(func=run_probe_content)
    pch = sub.add_parser("probe-charts", help="where a target's heads look when it answers a chart question",
                          description="Held-out chart questions, the answer fed in: at bar-value answers every "
                                      "head's attention mass on the asked bar, on the number printed above it, on "
                                      "the other image tokens and on text; and for every --chart-referents target "
                                      "(training/target/chart_referents.py) the mass its head puts there; and whether the visual "
                                      "tokens of 2 x n charts carry the --chart-words reading words (a bar's value, "
                                      "the tallest bar, a point's ordinal and value, the peak), read as the nearest "
                                      "word code of the recipe's codes (see research/chart_probe.py, research/chart_word_probe.py)")
    _probe_source(pch)
    pch.add_argument("--n", type=int, default=30,
                     help="bar-value questions, chart dialogues for the targets, and half the charts read for the "
                          "words (default: 30)")
    _probe_output(pch, "probe_charts")

    pch.set_defaults(func=run_probe_charts)
    ln = sub.add_parser("lane", help="keep a training lane in the repository as a small delta, and bring it back",
                         description="runs/ is not committed and a new checkout may not have it. `save` stores a "
                                     "training checkpoint as its difference from an exported model (int8 per row, "
                                     "tensors that did not move left out, the run's state.json kept); `restore` "
                                     "rebuilds a checkpoint directory to go on from with `specula train target "
                                     "--init-from DIR` or to read with `zoo eval --checkpoint DIR` (see research/lanes.py)")
    lsub = ln.add_subparsers(dest="action", required=True)
    lsave = lsub.add_parser("save", help="snapshot a training checkpoint against an exported model")
    lsave.add_argument("--ckpt", required=True, help="the training checkpoint (runs/X/ckpt)")
    lsave.add_argument("--base", default="zoo/weights/target",
                       help="the exported model the lane started from (default: zoo/weights/target)")
    lsave.add_argument("--out", required=True, help="the snapshot directory, e.g. research/lanes/<lane>")
    lsave.add_argument("--note", default=None, help="free text kept in lane.json, e.g. the lane's command")
    lrest = lsub.add_parser("restore", help="rebuild a snapshot's checkpoint directory")
    lrest.add_argument("--snapshot", required=True, help="the snapshot directory (research/lanes/<lane>)")
    lrest.add_argument("--out", required=True, help="a new directory for the checkpoint, e.g. runs/<lane>-init")
    lrest.add_argument("--base", default=None, help="the base model (default: the one recorded; its sha256 must match)")
    ln.set_defaults(func=run_lane)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m research`` with ``argv``; a bad input is one line on stderr and exit 2."""
    return run_command(build_parser(), argv)


def _probe_source(p) -> None:
    """A probe command's model: an exported one (default: the shipped target) or a training checkpoint."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="target", help="an exported model directory or zoo name (default: target)")
    src.add_argument("--checkpoint", default=None, help="a training checkpoint (runs/X/ckpt), rounded to fp16")


def _probe_output(p, stem: str) -> None:
    """A probe command's world seed, report files (``<stem>.json`` / ``.md``), output form and threads."""
    p.add_argument("--seed", type=int, default=0, help="world seed (default: 0)")
    p.add_argument("--out", default=None, help=f"also write {stem}.json and {stem}.md to this directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    p.add_argument("--threads", type=int, default=2)


def run_probe(args) -> int:
    set_threads(args)
    from research.probe import probe_cli

    return probe_cli(args)


def run_probe_sets(args) -> int:
    set_threads(args)
    from research.set_probe import probe_sets_cli

    return probe_sets_cli(args)


def run_probe_content(args) -> int:
    set_threads(args)
    from research.content_probe import probe_content_cli

    return probe_content_cli(args)


def run_probe_charts(args) -> int:
    set_threads(args)
    from research.chart_probe import probe_charts_cli

    return probe_charts_cli(args)


def run_lane(args) -> int:
    from research.lanes import lane_cli

    return lane_cli(args)
