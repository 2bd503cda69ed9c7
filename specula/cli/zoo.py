"""``specula zoo list | build | promote | eval | splice | refit-projector | export``: the embedded model family.

Each handler lives with its subject (zoo/store.py, training/build.py, training/promote.py, training/target/) and is
imported only when its command runs.
"""

from __future__ import annotations

from specula.cli.common import set_threads


def register(sub) -> None:
    """Add ``zoo`` and its commands to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("zoo", help="the shipped embedded model family",
                       description="List, build, evaluate, export and promote the embedded model family; splice or "
                                   "refit a training checkpoint.")
    zsub = p.add_subparsers(dest="zoo_cmd", required=True)
    ls = zsub.add_parser("list", help="show what is shipped (files, sizes, sha256 check)",
                         description="Every entry of the shipped zoo with its size, file count and training facts, "
                                     "the total against the 150 MB budget, and whether the manifest's sha256 "
                                     "sums still match (exit 1 when not).")
    ls.set_defaults(func=run_list)
    b = zsub.add_parser("build", help="regenerate the zoo from seeds: tokenizer, the target's stages, every drafter",
                        description="Runs the recipe of training/recipe.py: the tokenizer; the target's stages (code LM, "
                                    "tower, merge, joint stage, the direct route's caption and suite stages, the image-set "
                                    "stages); its "
                                    "export; then "
                                    "each drafter's `specula train` command against it (about 6.5 CPU-hours). "
                                    "Resumable: rerun the same command and finished steps are skipped; a drafter "
                                    "already exported in --zoo-dir for its target is skipped even when --run-dir "
                                    "is gone.")
    b.add_argument("--run-dir", default="runs/zoo", help="where training runs keep checkpoints (resumable)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--zoo-dir", default=None, help="where the zoo is written (default: the shipped zoo/weights)")
    b.add_argument("--arch", default="embedded", choices=["embedded", "tiny"], help="target size (tiny: for tests)")
    b.add_argument("--tokenizer-samples", type=int, default=20_000, help="world samples the tokenizer trains on")
    b.add_argument("--scale", type=float, default=1.0,
                   help="multiply every sample / image count of the recipe (default: 1 = the shipped weights' run)")
    b.add_argument("--skip-drafters", action="store_true", help="build the tokenizer and the target only")
    b.add_argument("--drafters-only", action="store_true",
                   help="train (or resume) only the drafters, against the target already in --zoo-dir: after a new "
                        "target was exported there, every drafter must be retrained on it (the candidate zoo: "
                        "--zoo-dir zoo/candidates)")
    b.add_argument("--warm-from", default=None, metavar="ZOO",
                   help="warm-start each drafter whose trainer can (eagle, msd and its ablations, flash, aasd) from "
                        "its export in this zoo, e.g. zoo/weights when the new target was fine-tuned from the shipped "
                        "one; the others train fresh (default: all fresh; training/drafters/warm_start.py)")
    b.add_argument("--warm-share", type=float, default=1 / 3,
                   help="with --warm-from: the share of the recipe's --samples a warm-started drafter trains "
                        "(default: 1/3; promote needs at least a quarter: training/promote.py MIN_WARM_SHARE)")
    b.add_argument("--drafter", action="append", default=None, metavar="NAME",
                   help="only this recipe drafter (repeatable; recipe order kept): with --drafters-only, two builds "
                        "over one zoo with disjoint --drafter sets and their own --run-dir train side by side "
                        "(a drafter that starts from another, massv from text_lm, needs that one exported first)")
    b.add_argument("--until", default=None, metavar="STAGE",
                   help="the last target stage to build and export (default: the shipped target's, "
                        "training/recipe.py SHIPPED_UNTIL; later stages make the candidate under way)")
    b.add_argument("--dry-run", action="store_true", help="print each step's configuration / command and exit")
    b.set_defaults(func=run_build)
    pr = zsub.add_parser("promote", help="ship the candidate zoo: its target and every drafter retrained for it",
                         description="Moves the candidate zoo (zoo/candidates: a retrained target and the recipe's "
                                     "drafters retrained on it, built with `specula zoo build --drafters-only "
                                     "--zoo-dir zoo/candidates`) into the shipped zoo and rewrites its manifest. "
                                     "Refuses, moving nothing, while a drafter of the recipe is missing there or was "
                                     "trained on another target.")
    pr.add_argument("--candidates", default=None, help="the candidate zoo (default: zoo/candidates)")
    pr.add_argument("--zoo-dir", default=None, help="the zoo to promote into (default: the shipped zoo/weights)")
    pr.add_argument("--check", action="store_true", help="only say what is missing (exit 1 while anything is)")
    pr.set_defaults(func=run_promote)
    e = zsub.add_parser("eval", help="quality gates of the shipped target (image vs blank image, captions, suites)")
    e.add_argument("--model", default="target", help="an exported model directory or zoo name (default: target)")
    e.add_argument("--checkpoint", default=None,
                   help="evaluate a training checkpoint (runs/X/ckpt) instead, its weights rounded to fp16 as "
                        "`zoo export` would store them")
    e.add_argument("--suites", default=None, help="comma-separated suites to run (default: all)")
    e.add_argument("--codes", action="store_true",
                   help="with --checkpoint of a word-code run: also answer each image suite's questions (and "
                        "write its captions) with exact word codes in place of the image tokens (what the LM reads "
                        "from a perfect tower) and with zero codes (<suite>_codes; VQA also gets the tower's "
                        "attribute readout)")
    e.add_argument("--scan-cells", action="store_true",
                   help="also feed the caption suite's scenes with their reference scan listing (all nine cells in "
                        "reading order) and report, for cells with and without an object, how often the model opens "
                        "the cell right ('a' vs 'no') and with what mean probability (caption_scan_cells): missed "
                        "objects against objects copied into empty places")
    e.add_argument("--n", type=int, default=100, help="samples per suite (default: 100)")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--threads", type=int, default=2)

    e.set_defaults(func=run_eval)
    sp = zsub.add_parser("splice", help="a checkpoint with one run's LM and other weights' vision tower + projector",
                         description="Copies the training checkpoint --ckpt to --out (state, optimizers, vision "
                                     "heads) with every vision tower and projector tensor taken from --vision-from "
                                     "(an exported model such as zoo/weights/target, or another checkpoint). Resume "
                                     "it with `specula train target --run-dir <parent of --out>`; --freeze-vision "
                                     "keeps the new vision side fixed. See training/target/splice.py.")
    sp.add_argument("--ckpt", required=True, help="the training checkpoint whose LM is kept (runs/X/ckpt)")
    sp.add_argument("--vision-from", required=True,
                    help="exported model directory or training checkpoint to take the tower and projector from")
    sp.add_argument("--out", required=True, help="new checkpoint directory to write (must not exist), e.g. "
                                                 "runs/Y/ckpt")
    sp.set_defaults(func=run_splice)
    rf = zsub.add_parser("refit-projector", help="a checkpoint with its projector fitted again, with a code per cell",
                         description="Copies the training checkpoint --ckpt to --out with its projector fitted again "
                                     "in closed form onto the run's word codes plus --cell-codes times a code of its "
                                     "own for each of the nine layout cells (object patches only). The other tokens "
                                     "stay as they were; resume with `specula train target --run-dir <parent of "
                                     "--out> --freeze-vision`. See training/target/refit.py.")
    rf.add_argument("--ckpt", required=True, help="the training checkpoint to copy (runs/X/ckpt)")
    rf.add_argument("--out", required=True, help="new checkpoint directory to write (must not exist)")
    rf.add_argument("--cell-codes", type=float, default=1.0,
                    help="weight of the cell code in an object patch's target (default: 1; 0 = refit onto the "
                         "plain word codes)")
    rf.add_argument("--images", type=int, default=960, help="training images to fit on (default: 960)")
    rf.add_argument("--no-gate", action="store_true",
                    help="do not gate background patches to exact zeros (the default gates them, as "
                         "--projector-fit-gate does in training)")
    rf.set_defaults(func=run_refit)
    x = zsub.add_parser("export", help="copy a training checkpoint into the shipped zoo (fp16) and update the manifest")
    x.add_argument("--ckpt", default="runs/target/ckpt", help="checkpoint directory (default: runs/target/ckpt)")
    x.add_argument("--out", default=None,
                   help="target directory to write instead of the shipped one (its parent gets the manifest), e.g. "
                        "runs/zoo-next/target to stage a candidate and train drafters on it with --target")
    x.set_defaults(func=run_export)


def run_list(args) -> int:
    from specula.zoo.store import list_cli

    return list_cli(args)


def run_build(args) -> int:
    from specula.training.build import build_cli

    return build_cli(args)


def run_promote(args) -> int:
    from specula.training.promote import promote_cli

    return promote_cli(args)


def run_eval(args) -> int:
    set_threads(args)
    from specula.training.target.evaluate import eval_cli

    return eval_cli(args)


def run_splice(args) -> int:
    from specula.training.target.splice import splice_cli

    return splice_cli(args)


def run_refit(args) -> int:
    from specula.training.target.refit import refit_cli

    return refit_cli(args)


def run_export(args) -> int:
    from specula.training.build import export_cli

    return export_cli(args)
