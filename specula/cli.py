"""The ``specula`` command line. Each subcommand's work lives next to its subject; this file only parses.

    specula generate --image world/assets/sample.png --question "What colour is the circle?"
    specula world sample --suite vqa --n 4 --out /tmp/world
    specula bench target --out reports/target
    specula train target --run-dir runs/target
    specula train msd --no-decouple           # an MSD ablation
    specula zoo list | build | eval --json | probe | export
    specula chat --image scene.png "What colour is the circle?"   # ask a running `specula serve` over gRPC
"""

from __future__ import annotations

import argparse
import sys

# world/suites.py MIXES, named here so that --help does not import the world (a test keeps the two equal)
MIX_NAMES = ["base", "dialogue", "lookup", "scenes", "describe", "confusable", "scenes_confusable", "confusable_scan",
             "scan_captions", "colour_captions", "scan_suites", "scan_multi", "scan_multi_odd",
             "scan_suites_count", "scan_suites_sets", "scan_suites_charts", "scan_placed", "scan_placed_multi"]


def _threads(args) -> None:
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="answer a prompt about one or more images with a target model",
                       description="Load a target (the shipped embedded target by default, or a local checkpoint "
                                   "directory) and answer a question about images; prints the answer and tokens/s.")
    p.add_argument("--image", action="append", default=[], help="image file (repeat for several images)")
    p.add_argument("--question", required=True, help="the user's question; one <image> per image is added in front")
    p.add_argument("--model", default="target", help="zoo entry name or local checkpoint directory (default: target)")
    p.add_argument("--max-tokens", type=int, default=96, help="maximum new tokens (default: 96)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")

    def run(args):
        _threads(args)
        from specula.runtime.engine.generate import main as gen_main

        return gen_main(args)

    p.set_defaults(func=run)


def _add_world(sub) -> None:
    p = sub.add_parser("world", help="look at the embedded multimodal world")
    wsub = p.add_subparsers(dest="world_cmd", required=True)
    s = wsub.add_parser("sample", help="write example samples (PNGs + prompts/answers) so a person can look at them")
    s.add_argument("--suite", action="append", default=[], help="suite name (repeatable; default: all suites)")
    s.add_argument("--n", type=int, default=3, help="samples per suite (default: 3)")
    s.add_argument("--split", default="eval", choices=["train", "eval"], help="which split (default: eval)")
    s.add_argument("--out", default="world_samples", help="output directory (default: ./world_samples)")
    s.add_argument("--seed", type=int, default=0)

    def run_sample(args):
        from specula.world.show import write_samples

        path = write_samples(args.out, args.suite or None, args.n, args.split, args.seed)
        print(f"wrote {path}")
        return 0

    s.set_defaults(func=run_sample)
    ls = wsub.add_parser("suites", help="list the evaluation suites and what they mirror")

    def run_suites(args):
        from specula.world.suites import SUITES

        for s in SUITES.values():
            print(f"{s.name:12s} {s.task:10s} mirrors {s.mirrors}")
        return 0

    ls.set_defaults(func=run_suites)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON + markdown, ratios measured in one run)")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    t = bsub.add_parser("target", help="target costs: params, T_decode, T_verify(gamma)/T_decode, prefill, vision encode")
    t.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    t.add_argument("--out", default="reports/bench-target", help="output directory for JSON + markdown")
    t.add_argument("--max-gamma", type=int, default=8, help="largest gamma measured (default: 8)")
    t.add_argument("--repeats", type=int, default=20, help="timed repeats per figure (median reported; default: 20)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=2)

    def run(args):
        _threads(args)
        from specula.runtime.bench.target import main as bench_main

        return bench_main(args)

    t.set_defaults(func=run)
    sp = bsub.add_parser("spec", help="speculative vs plain decoding (our engine, HF generate, HF assisted) per suite",
                         description="Runs every configuration round robin on the same prompts and writes JSON, "
                                     "markdown and PNG plots (tau per suite, alpha_n, speedup vs gamma).")
    sp.add_argument("--model", default="target", help="zoo entry or local checkpoint directory (default: target)")
    sp.add_argument("--drafter", action="append", default=[],
                    help='drafter kind or JSON config, repeatable (default: ngram), e.g. --drafter \'{"kind": "ngram", "max_n": 3}\'')
    sp.add_argument("--gamma", action="append", type=int, default=[], help="draft length, repeatable (default: 5)")
    sp.add_argument("--suite", action="append", default=[], help="evaluation suite, repeatable (default: all)")
    sp.add_argument("--n", type=int, default=6, help="prompts per suite (default: 6)")
    sp.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most (default: 64)")
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sp.add_argument("--no-hf", action="store_true", help="skip the HF generate / assisted baselines")
    sp.add_argument("--out", default="reports/bench-spec", help="output directory (default: reports/bench-spec)")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: the target's and the drafters' device "
                                                   "(default: cpu)")

    def run_spec(args):
        _threads(args)
        from specula.runtime.bench.spec import main as spec_main

        return spec_main(args)

    sp.set_defaults(func=run_spec)
    rp = bsub.add_parser("report", help="every available drafter on every suite, side by side: JSON + markdown + "
                                         "PNG report in reports/<date>-<machine>/",
                         description="Runs the main table (tau and speedup per drafter x suite), alpha_n, gamma "
                                     "sweep, temperature 0 and 1, time split, multi-image scaling, throughput vs "
                                     "concurrency, HF generate / assisted, target costs, wire bytes per codec and "
                                     "the distributed overlap where available, then one line per seed paper's claim. "
                                     "A section that cannot run records why.")
    from specula.runtime.bench.report.args import add_arguments as report_arguments

    report_arguments(rp)

    def run_report(args):
        _threads(args)
        from specula.runtime.bench.report.run import main as report_main

        return report_main(args)

    rp.set_defaults(func=run_report)
    dp = bsub.add_parser("distributed", help="distributed runtime: pipelined (overlap) vs sequential vs single "
                                             "process vs plain, drafter in its own process",
                         description="Drafter server and verifier in separate processes (one torch thread each, "
                                     "loopback gRPC); every configuration round robin on the same prompts; JSON + "
                                     "markdown with tau, speedups, overlap efficiency, time split and wire bytes.")
    from specula.runtime.bench.distributed import add_arguments as distributed_arguments

    distributed_arguments(dp)

    def run_distributed(args):
        from specula.runtime.bench.distributed import main as distributed_main

        return distributed_main(args)

    dp.set_defaults(func=run_distributed)

    op = bsub.add_parser("outcomes", help="how often a verdict's outcome is among the drafter's top predicted "
                                          "outcomes: the ceiling of drafting ahead (no timing)",
                         description="Greedy SpecEngine runs in which the drafter ranks its guess and its likeliest "
                                     "rejection outcomes before every verdict; JSON + markdown with the share of "
                                     "blocks covered by the top 1 .. m outcomes.")
    from specula.runtime.bench.outcomes import add_arguments as outcomes_arguments

    outcomes_arguments(op)

    def run_outcomes(args):
        from specula.runtime.bench.outcomes import main as outcomes_main

        return outcomes_main(args)

    op.set_defaults(func=run_outcomes)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model of the embedded family (resumable)")
    tsub = p.add_subparsers(dest="train_cmd", required=True)
    t = tsub.add_parser("target", help="train the embedded LLaVA target from scratch on the world (resumes from run-dir)")
    t.add_argument("--run-dir", default="runs/target", help="checkpoints and log go here; an existing run resumes")
    t.add_argument("--samples", type=int, default=40_000, help="training samples in all (default: 40000)")
    t.add_argument("--arch", default="embedded", choices=["embedded", "tiny"], help="model size (tiny: for tests)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--ckpt-every", type=float, default=240.0, help="seconds between checkpoints (default: 240)")
    t.add_argument("--eval-every", type=float, default=600.0, help="seconds between image-vs-blank checks (default: 600)")
    t.add_argument("--vision-images", type=int, default=4_000,
                   help="stage 0: images for the tower + projector stage before joint training (default: 4000); "
                        "raising it on a resumed run trains the vision stage further before joint training goes on")
    t.add_argument("--vision-lr", type=float, default=None,
                   help="learning rate of the vision stage (default: the same as --lr)")
    t.add_argument("--vision-pos-lr-mult", type=float, default=1.0,
                   help="learning-rate multiplier of the vision tower's position embeddings in the vision stage "
                        "(default: 1). They start far quieter than the patch content; without a boost the tower "
                        "barely learns where a patch is")
    t.add_argument("--vision-place-weight", type=float, default=0.0,
                   help="vision stage: weight of a dense head that reads each patch's 3 x 3 layout cell (default: 0, "
                        "off). Colour and shape can be read from a bag of patches; this head makes the tower carry "
                        "where each patch is to its last layer")
    t.add_argument("--freeze-vision", action="store_true",
                   help="joint stage: keep the tower and projector as the vision stage and projector fit left them; "
                        "only the LM trains")
    t.add_argument("--freeze-projector", action="store_true",
                   help="joint stage: keep the projector (and the background gate of --projector-fit-gate) as the "
                        "fit left it; the tower and the LM train, the LM's gradient reaching the tower through it")
    t.add_argument("--tower-lr-mult", type=float, default=1.0,
                   help="joint stage: the vision tower's learning rate as a multiple of --lr (default: 1). A tower "
                        "aligned to the word codes drifts off them at the LM's rate")
    t.add_argument("--projector-fit-images", type=int, default=0,
                   help="word-code recipe: after the vision stage, fit the projector in closed form (ridge "
                        "regression of the codes on the tower's features) on this many images, once per run and "
                        "again whenever a resumed run extends the vision stage (default: 0, off; 960 is plenty)")
    t.add_argument("--projector-fit-gate", action="store_true",
                   help="with --projector-fit-images: also gate background patches to exact zeros (a closed-form "
                        "object/background score closes every hidden unit of the projector there)")
    t.add_argument("--background-code", action="store_true",
                   help="word-code recipe: background patches get a code of their own instead of zero (an LM "
                        "trained on a zero background is thrown by the tower's small errors there)")
    t.add_argument("--code-background-noise", type=float, default=0.0,
                   help="code LM stage: random vectors with norms up to this on background patches instead of "
                        "exact zeros, so the LM learns to ignore the tower's small errors there (default: 0)")
    t.add_argument("--export", action="store_true", help="when done, export the weights into the shipped zoo")
    t.add_argument("--init-from", default=None,
                   help="exported weights (e.g. zoo/weights/target) to continue from when --run-dir has no checkpoint; "
                        "with the word-code flags the code LM, vision and projector-fit stages count as done and only "
                        "the joint stage runs (the vision heads start fresh: see --vis-weight)")
    t.add_argument("--vis-weight", type=float, default=0.5,
                   help="joint stage: weight of the dense vision-head loss on the tower's features (default: 0.5; 0 "
                        "= off, e.g. after --init-from, whose vision heads start untrained)")
    t.add_argument("--mix", default="base", choices=MIX_NAMES,
                   help="training mix (world/suites.py): base (one question per sample), dialogue (12-turn scene "
                        "dialogues per image, ~10x the grounded answers per forward), lookup (mostly scenes "
                        "described in words, as dialogues: the LM's copy-from-context skill, cheaply), scenes "
                        "(almost only scene dialogues), describe (dialogue with twice the scene captions), confusable "
                        "(describe plus dialogues about scenes whose objects share colours and shapes), "
                        "scenes_confusable (scenes plus those dialogues), confusable_scan (confusable with scene "
                        "captions that name all nine cells in reading order), scan_captions (confusable_scan with "
                        "twice the captions), colour_captions (scan_captions with the captions listed by colour "
                        "instead of by cell), scan_suites (scan_captions plus dialogues about charts, image sets and "
                        "clips), scan_multi (scan_suites with image sets at about a third of the samples, their "
                        "captions worded \"Image N has ...\"), scan_multi_odd (scan_multi plus dialogues about sets "
                        "with an odd one out, about one sample in eight), scan_suites_count (scan_suites plus "
                        "dialogues about sets built for counting, their counts drawn evenly from zero to the set's "
                        "size, about one sample in ten), scan_suites_sets (scan_suites_count plus dialogues about sets "
                        "with an odd one out, about one sample in twelve), scan_suites_charts (scan_suites_count with "
                        "twice the chart dialogues, about one sample in eight), scan_placed (scan_suites with half the prompts "
                        "asked with text or the question before the image, or after a system turn) or "
                        "scan_placed_multi (scan_multi placed the same way)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    t.add_argument("--token-budget", type=int, default=4096,
                   help="tokens per optimizer step (rows x longest row; default: 4096). Smaller budgets give more "
                        "updates for the same compute")
    t.add_argument("--object-cell-weight", type=float, default=1.0,
                   help="loss weight on the word that opens a scan listing's object cell ('top, a ...': the 'a'), "
                        "against the 'no object' verdicts that make up two cells in three (default: 1 = off; "
                        "training/target/cell_weights.py)")
    t.add_argument("--stop-at", type=int, default=0,
                   help="stop with a checkpoint once the run reaches this many samples, keeping the learning-rate "
                        "schedule of --samples (a later run with a higher --stop-at or none goes on from there; "
                        "default: 0 = run to --samples)")
    t.add_argument("--device", default="cpu",
                   help="where the joint stage trains: cpu, cuda or cuda:N (default: cpu). The earlier stages (code "
                        "LM, vision, projector fit) run on the CPU; a run started with --init-from goes straight to "
                        "the joint stage")
    t.add_argument("--image-consistency", type=float, default=0.0,
                   help="weight of a loss that pulls the hidden states, in every layer, of each row's first image "
                        "when it does not open its prompt (text or a system turn in front) towards the same "
                        "model's states for that image alone at the start (default: 0 = off; training/target/train.py "
                        "image_consistency_loss)")
    t.add_argument("--twin-states", type=float, default=0.0,
                   help="weight of a loss that pulls a moved prompt's states (a lead line, a system turn or the "
                        "question in front of the image; --mix scan_placed), every layer, over the tokens it ends "
                        "with in common with its image-first twin, towards the twin's states (no gradient through "
                        "the twin; default: 0 = off; training/target/train.py twin_losses)")
    t.add_argument("--twin-answer", type=float, default=0.0,
                   help="weight of KL(twin || moved) of the next-token distributions at a moved prompt's answer "
                        "tokens, the twin being the same sample with its image first (default: 0 = off; "
                        "training/target/train.py twin_losses)")
    t.add_argument("--set-consistency", type=float, default=0.0,
                   help="weight of a loss that pulls the hidden states, in every layer, of each image of an image "
                        "set that does not open its prompt (the second and later images, or a first one after "
                        "'Image 1: ') towards the same model's states for that image alone at the start; clips are "
                        "left out (default: 0 = off; training/target/train.py set_consistency_loss)")
    t.add_argument("--set-consistency-layers", type=int, default=0,
                   help="pull only the outputs of the first N decoder layers with --set-consistency, so the layers "
                        "above stay free to add each image's number (--set-marks) (default: 0 = every layer)")
    t.add_argument("--set-referents", type=float, default=0.0,
                   help="weight of an attention loss that teaches which image of a set is meant: for each 'which "
                        "image' question and each 'Image n has ...' caption line, head 0 of layer 2 attends to the "
                        "ordinal (or the line's number) and head 0 of layer 4 to that image's object patches "
                        "(default: 0 = off; training/target/set_referents.py)")
    t.add_argument("--set-index", type=float, default=0.0,
                   help="weight of an attention loss that gives a set's image tokens their image's number: at each "
                        "object patch of image n, head 1 of layer 1 spreads its mass evenly over the first token and "
                        "the first token of images 1..n (default: 0 = off; training/target/set_referents.py set_index_targets)")
    t.add_argument("--set-marks", type=float, default=0.0,
                   help="weight of an attention loss that gives a set's image tokens their image's number from the "
                        "prompt: at each object patch of image n, head 2 of layer 1 (layer 0 with --set-hops shallow "
                        "or reader) attends to the number of the 'Image n:' marker before it (use with "
                        "--number-images; default: 0 = off; training/target/set_referents.py set_mark_targets)")
    t.add_argument("--set-hops", choices=("deep", "shallow", "reader"), default="deep",
                   help="where the --set-referents / --set-marks hops sit: deep (ordinal at layer 2, the named "
                        "image's patches at layer 4, marks at layer 1) or shallow (layers 0 and 1, head 0: the heads "
                        "the scene lookups read colours with; marks at layer 0 head 2) or reader (as shallow with the "
                        "ordinal on head 4 of layer 0, apart from the scene word hop) (default: deep; "
                        "training/target/set_referents.py)")
    t.add_argument("--set-readout", type=float, default=0.0,
                   help="weight of a loss that makes the head of the named image's patch hop say what it sees: at "
                        "each 'which image' answer and each colour or shape word of an 'Image n has ...' caption "
                        "line, that head's output alone, read through the final norm and LM head, must predict the "
                        "word (builds the --set-referents targets; default: 0 = off; training/target/set_readout.py)")
    t.add_argument("--set-isolation", type=float, default=0.0,
                   help="weight of an attention loss that keeps each later image of a set from reading the images "
                        "before it: at its object patches, every layer's and head's mass on the earlier images' "
                        "tokens is penalised (default: 0 = off; training/target/set_isolation.py)")
    t.add_argument("--set-odd", type=float, default=0.0,
                   help="weight of an attention loss for 'which image is different / the odd one out?' answers: "
                        "head 3 of layer 1 spread over every image's objects (the set's common look) and head 0 of "
                        "layer 2 on the odd image's object patches, whose image number (--set-marks) is the answer "
                        "(default: 0 = off; training/target/set_referents.py set_odd_targets)")
    t.add_argument("--chart-referents", type=float, default=0.0,
                   help="weight of an attention loss for chart questions about one part of the chart (a bar's or "
                        "point's value; the tallest bar, the peak, the largest slice): the scene lookup's hops "
                        "(head 0 of layer 0 on a bar's colour word, head 0 of layer 1 on the part's patches) and, "
                        "for a value, head 3 of layer 3 on the number printed above the part (with --chart-words: "
                        "no number hop, the part's own tokens carry its value); needs an LM of 4+ "
                        "layers and heads (default: 0 = off; training/target/chart_referents.py)")
    t.add_argument("--chart-readout", type=float, default=0.0,
                   help="weight of a readout loss on --chart-referents' lookup: at the answer of a value question "
                        "(a bar's or point's value), head 0 of layer 1 (the head that finds the asked part), read out "
                        "alone through the final norm and LM head, must say the value; needs --chart-referents, and "
                        "--chart-words for the value to be on the part (default: 0 = off; training/target/chart_readout.py)")
    t.add_argument("--chart-words", nargs="?", const="parts", default="", choices=("parts", "whole"),
                   help="the word codes of a chart's parts also name what each part shows, so that the vision stage "
                        "and the projector fit put that on the part's own visual tokens: 'parts' (the flag alone) a "
                        "bar's value and, on the tallest, 'tallest', a line point's ordinal, value and, on the peak, "
                        "'highest'; 'whole' also the number of bars or slices on each, 'largest' on the largest "
                        "slice, and on the last point whether the line ends 'higher' or 'lower'; raise "
                        "--vision-images on a resumed run to retrain the tower with them (default: off; "
                        "training/target/chart_words.py)")
    t.add_argument("--set-count", type=float, default=0.0,
                   help="weight of an attention loss for 'how many images show a ...?' answers: head 3 of layer 0 "
                        "reads each image's objects onto the token after it, and at the answer head 2 of layer 1 "
                        "spreads over the first token and those tokens of the images showing the shape, so 1/(m+1) "
                        "stays on the first token; a set without its 'Image n:' markers gets none (--number-images adds "
                        "them) (default: 0 = off; training/target/set_count.py)")
    t.add_argument("--set-count-readout", type=float, default=0.0,
                   help="weight of a readout loss on --set-count's summary hops: at the token after each image the "
                        "summary head's own output, read through the LM head, should say the shapes that image shows "
                        "(so the count hop can match them against the asked shape word) (default: 0 = off; "
                        "training/target/set_readout.py summary_readout_loss)")
    t.add_argument("--set-count-number-readout", type=float, default=0.0,
                   help="weight of a readout loss on --set-count's count hop: at each counting answer the count "
                        "head's own output, read through the LM head, should say the number (builds the count "
                        "targets; default: 0 = off; training/target/set_readout.py count_readout_loss)")
    t.add_argument("--set-count-key-fit", type=int, default=0, metavar="N",
                   help="before the joint stage, once per run: fit what each image of N counting dialogues shows "
                        "from the count layer's input at its summary token, write the fit into the count head's "
                        "keys (the slowest rotary pairs) and zero the head's query there, so the count hop's "
                        "query can learn the match instead of sitting at the saddle of an untrained query and key "
                        "(needs --set-count or --set-count-readout and --number-images; default: 0 = off; "
                        "training/target/set_count_fit.py)")
    t.add_argument("--set-count-query-steps", type=int, default=0, metavar="N",
                   help="with --set-count-key-fit: then N Adam steps on the count head's query alone against the "
                        "count hop's targets on the same dialogues (rotary positions and causal softmax exact), so "
                        "the joint stage starts with the match in place (default: 0 = off; training/target/set_count_fit.py)")
    t.add_argument("--number-images", action="store_true",
                   help="train on prompts whose image sets are numbered ('Image 1: <image> Image 2: <image> ...', "
                        "added where missing); the exported processor numbers them the same way for every caller "
                        "(default: off; targets/image_marks.py)")
    t.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop the joint stage with a checkpoint after this many minutes of this invocation, e.g. to "
                        "fit a lease or a session (rerunning goes on; default: 0 = no limit)")
    t.add_argument("--object-phrase-weight", type=float, default=1.0,
                   help="loss weight on the rest of an object cell's phrase ('top, a large purple cross;': 'large "
                        "purple cross'), the object read by its place (default: 1 = off; training/target/cell_weights.py)")
    t.add_argument("--user-loss", type=float, default=0.0,
                   help="weight of an auxiliary next-token loss on the user turns' words (default: 0 = off): each "
                        "question names objects of the scene, so predicting it needs the image")
    t.add_argument("--aux-out", type=float, default=0.25,
                   help="weight of the dense patch-word loss on the LM's last hidden state at the image positions "
                        "(default: 0.25; 0 = off)")
    t.add_argument("--code-lm-samples", type=int, default=0,
                   help="word-code recipe (training/target/word_codes.py): samples of a first stage in which the LM alone learns "
                        "the world with fixed word codes in place of the image tokens; the vision stage then regresses "
                        "tower + projector onto the codes (default: 0 = off). Raising it on a resumed run extends the "
                        "stage, until the joint stage has begun")
    t.add_argument("--code-lm-layers", type=int, default=0,
                   help="train only the first N decoder layers in the code LM stage, then start the others as "
                        "identities (default: 0 = all layers)")
    t.add_argument("--code-lm-lr", type=float, default=1e-3, help="peak learning rate of the code LM stage (default: 1e-3)")
    t.add_argument("--code-token-budget", type=int, default=1024,
                   help="tokens per optimizer step in the code LM stage (default: 1024)")
    t.add_argument("--code-lm-mix", default="dialogue", choices=MIX_NAMES,
                   help="training mix of the code LM stage (same names as --mix; default: dialogue)")
    t.add_argument("--code-lm-stop", type=int, default=0,
                   help="end the code LM stage at this many samples, on --code-lm-samples' schedule, unfinished: a "
                        "later run of the same directory (e.g. with more --code-lm-layers) goes on (default: 0 = off)")
    t.add_argument("--referent-attention", type=float, default=0.0,
                   help="weight of the referent-attention loss (training/target/referents.py): for each lookup question, head 0 "
                        "of layer 0 attends to the question's referent words and head 0 of layer 1 to the "
                        "referent's image tokens (default: 0 = off)")
    t.add_argument("--caption-referents", action="store_true",
                   help="with --referent-attention: captions that scan the cells too (--mix confusable_scan): each "
                        "object phrase attends to its cell's place words and the object's patches, an empty cell's "
                        "\"no object\" to the sequence's first token, each next cell name to the previous cell's name")
    t.add_argument("--vision-from", default=None,
                   help="a run's ckpt directory: a fresh run starts its tower, projector and vision heads from it "
                        "and counts its vision images as done, and its projector fit when it has one (same seed "
                        "and arch, both word-code runs)")
    t.add_argument("--lm-from", default=None,
                   help="a word-code run's ckpt directory whose code LM stage is done and whose joint stage has not "
                        "begun: a fresh run starts its language model and code-stage progress from it. With "
                        "--vision-from this pairs a code LM with a tower trained elsewhere")

    def run(args):
        from specula.training.build import train_target_cli

        return train_target_cli(args)

    t.set_defaults(func=run)

    x = tsub.add_parser("text_lm", help="distil the text-only drafter LM from the target's own answers (resumable)",
                        description="Stage 1 asks the target (with the image) for greedy answers on world training "
                                    "prompts and keeps its top-k log-probs; stage 2 trains a small Llama on the "
                                    "prompts without their images. Both stages resume from --run-dir.")
    _distill_args(x, "text_lm", data=30_000, samples=240_000)
    x.add_argument("--arch", default="embedded", choices=["embedded", "tiny"], help="drafter size (tiny: for tests)")
    x.set_defaults(func=lambda a: __import__("specula.training.drafters.text_lm", fromlist=["x"]).train_text_lm_cli(a))

    e = tsub.add_parser("eagle", help="train the EAGLE head on the target's hidden states (resumable)",
                        description="Stage 1 caches the target's greedy answers on world training prompts; stage 2 "
                                    "trains one decoder layer over fc(concat(embedding, hidden)) with SmoothL1 on the "
                                    "next hidden state + cross-entropy through the frozen lm_head.")
    _init_from_arg(e, "eagle")
    _distill_args(e, "eagle", data=10_000, samples=60_000)
    e.set_defaults(func=lambda a: __import__("specula.training.drafters.eagle", fromlist=["x"]).train_eagle_cli(a))

    m = tsub.add_parser("msd", help="train the MSD head: decoupled visual tokens, text-only stage then a progressive "
                                    "text -> multimodal mix (resumable)",
                        description="Caches the target's greedy answers to text-only conversations (D_text) and to "
                                    "multimodal world training prompts (D_vis, --data-samples of them), then trains "
                                    "the EAGLE-shaped head reading raw visual embeddings at image positions: stage 1 "
                                    "on D_text, stage 2 on D_text (T-t)/T + D_vis t/T. The ablation flags with the "
                                    "default --run-dir train in runs/msd-no-decouple / runs/msd-no-stage1 on "
                                    "runs/msd/data and export to zoo/weights/msd-no-decouple / msd-no-stage1.")
    _init_from_arg(m, "msd")
    _distill_args(m, "msd", data=10_000, samples=60_000)
    m.add_argument("--text-samples", type=int, default=None,
                   help="text-only target answers for stage 1 and the mix (default: = --data-samples)")
    m.add_argument("--stage1-fraction", type=float, default=1 / 3,
                   help="share of --samples spent in stage 1 (default: 1/3)")
    m.add_argument("--no-stage1", action="store_true", help="ablation: no text-only stage; the mix from the start")
    m.add_argument("--no-decouple", action="store_true",
                   help="ablation: visual positions read fc(concat(e, h)) as in eagle instead of the raw embeddings")
    m.add_argument("--data-dir", default=None, help="where the target answers are cached (default: <run-dir>/data)")
    m.set_defaults(func=lambda a: __import__("specula.training.drafters.msd", fromlist=["x"]).train_msd_cli(a))

    mv = tsub.add_parser("massv", help="train the MASSV drafter: a small LM + its own projector over the target's "
                                       "vision features; projector pretraining, then SDViT (resumable)",
                         description="Phase 1 trains only the projector (LM frozen) on the world's image-caption "
                                     "pairs; phase 2 (SDViT) fine-tunes projector + LM on the target's own sampled "
                                     "answers to visual instructions (--data-samples prompts, temperatures 0 / 0.7 "
                                     "/ 1, top-p 0.9). --no-sdvit: phase 2 on the world's reference answers instead "
                                     "(the paper's ablation; with the default --run-dir trains in runs/massv-no-sdvit "
                                     "and exports to zoo/weights/massv-no-sdvit). --samples counts phase 2, "
                                     "--pretrain-samples phase 1.")
    _distill_args(mv, "massv", data=10_000, samples=40_000)
    mv.add_argument("--pretrain-samples", type=int, default=20_000,
                    help="phase 1: caption samples seen while pretraining the projector (default: 20000)")
    mv.add_argument("--init-lm", default="text_lm",
                    help="the LM to start from: a zoo name or directory of a Llama (default: text_lm); 'none' = fresh")
    mv.add_argument("--arch", default="embedded", choices=["embedded", "tiny"], help="size of a fresh LM (--init-lm none)")
    mv.add_argument("--feature", default="pre_projector", choices=["pre_projector", "projected"],
                    help="which target features the projector reads (default: pre_projector, as MASSV)")
    mv.add_argument("--no-sdvit", action="store_true", help="ablation: phase 2 on the world's reference answers")
    mv.add_argument("--text-every", type=int, default=0,
                    help="every n-th phase-2 sample is the target's answer to a text-only conversation (data_samples "
                         "/ n of them), so the LM keeps plain text (default: 0 = none)")
    mv.set_defaults(func=lambda a: __import__("specula.training.drafters.massv", fromlist=["x"]).train_massv_cli(a))

    f = tsub.add_parser("flash", help="train the FLASH head: latent visual compression + a k-token semi-autoregressive "
                                      "head (resumable)",
                        description="Caches the target's greedy answers on world training prompts, then trains the "
                                    "EAGLE-shaped layer over the draft sequence (each image compressed to "
                                    "--visual-tokens latent tokens by learned queries) with --tokens-per-pass output "
                                    "blocks: SmoothL1 on the next k hidden states + lambda * cross-entropy.")
    _init_from_arg(f, "flash")
    _distill_args(f, "flash", data=10_000, samples=60_000)
    f.add_argument("--tokens-per-pass", type=int, default=4, help="k: draft tokens per head forward (default: 4)")
    f.add_argument("--visual-tokens", type=int, default=64, help="m: latent tokens per image (default: 64)")
    f.add_argument("--data-dir", default=None, help="where the target answers are cached (default: <run-dir>/data; "
                                                    "runs/eagle/data shares eagle's)")
    f.set_defaults(func=lambda a: __import__("specula.training.drafters.flash", fromlist=["x"]).train_flash_cli(a))

    a_ = tsub.add_parser("aasd", help="train the AASD draft layer over the target's last-layer KV cache with "
                                      "Target-Draft Attention (resumable)",
                         description="Caches the target's greedy answers on world training prompts, then trains one "
                                     "decoder layer (initialised from the target's last) that attends the target's "
                                     "last-layer K/V (each image compressed to --kv-tokens entries by the learned "
                                     "KV projector) and its own chain, every chain start and depth up to "
                                     "--train-depth at once.")
    _init_from_arg(a_, "aasd")
    _distill_args(a_, "aasd", data=10_000, samples=60_000)
    a_.add_argument("--kv-tokens", type=int, default=64, help="k: compressed KV entries per image (default: 64)")
    a_.add_argument("--train-depth", type=int, default=5, help="chain depths trained per position (default: 5)")
    a_.add_argument("--data-dir", default=None, help="where the target answers are cached (default: <run-dir>/data; "
                                                     "runs/eagle/data shares eagle's)")
    a_.set_defaults(func=lambda a: __import__("specula.training.drafters.aasd", fromlist=["x"]).train_aasd_cli(a))


def _init_from_arg(p, kind: str) -> None:
    p.add_argument("--init-from", default=None,
                   help=f"warm start: an exported {kind} head (a zoo name or directory) of the same config to start "
                        "from instead of a fresh one, e.g. the shipped one when the target was fine-tuned further; "
                        "ignored when --run-dir already has a checkpoint (default: fresh; training/drafters/warm_start.py)")


def _distill_args(p, kind: str, data: int, samples: int) -> None:
    """Arguments shared by the drafter recipes that distil from the target's own answers."""
    p.add_argument("--run-dir", default=f"runs/{kind}", help=f"data, checkpoints and log (default: runs/{kind})")
    p.add_argument("--target", default="target", help="zoo entry or local target directory (default: target)")
    p.add_argument("--data-samples", type=int, default=data, help=f"target answers to distil from (default: {data})")
    p.add_argument("--samples", type=int, default=samples, help=f"training samples in all (default: {samples})")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest target answer kept (default: 96)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--ckpt-every", type=float, default=240.0, help="seconds between checkpoints")
    p.add_argument("--eval-every", type=float, default=600.0, help="seconds between held-out evaluations")
    p.add_argument("--export", action="store_true", help="when done, export into the zoo (or --out)")
    p.add_argument("--out", default=None, help=f"export directory (default: zoo/weights/{kind})")


def _add_zoo(sub) -> None:
    p = sub.add_parser("zoo", help="the shipped embedded model family")
    zsub = p.add_subparsers(dest="zoo_cmd", required=True)
    ls = zsub.add_parser("list", help="show what is shipped (files, sizes, sha256 check)")
    ls.set_defaults(func=lambda a: __import__("specula.zoo.store", fromlist=["x"]).list_cli(a))
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
    b.set_defaults(func=lambda a: __import__("specula.training.build", fromlist=["x"]).build_cli(a))
    pr = zsub.add_parser("promote", help="ship the candidate zoo: its target and every drafter retrained for it",
                         description="Moves the candidate zoo (zoo/candidates: a retrained target and the recipe's "
                                     "drafters retrained on it, built with `specula zoo build --drafters-only "
                                     "--zoo-dir zoo/candidates`) into the shipped zoo and rewrites its manifest. "
                                     "Refuses, moving nothing, while a drafter of the recipe is missing there or was "
                                     "trained on another target.")
    pr.add_argument("--candidates", default=None, help="the candidate zoo (default: zoo/candidates)")
    pr.add_argument("--zoo-dir", default=None, help="the zoo to promote into (default: the shipped zoo/weights)")
    pr.add_argument("--check", action="store_true", help="only say what is missing (exit 1 while anything is)")
    pr.set_defaults(func=lambda a: __import__("specula.training.promote", fromlist=["x"]).promote_cli(a))
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

    def run_eval(args):
        _threads(args)
        from specula.training.target.evaluate import eval_cli

        return eval_cli(args)

    e.set_defaults(func=run_eval)
    pr = zsub.add_parser("probe", help="where grounding fails: real vs oracle visual tokens vs the scene in words",
                         description="VQA accuracy per question type with the target's own visual tokens and with "
                                     "oracle ones (each object patch replaced by its words' embeddings), and the "
                                     "same questions about a scene described in words (see research/probe.py)")
    pr.add_argument("--model", default="target")
    pr.add_argument("--n", type=int, default=100, help="questions (default: 100)")
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.add_argument("--threads", type=int, default=2)

    def run_probe(args):
        _threads(args)
        from research.probe import probe_cli

        return probe_cli(args)

    pr.set_defaults(func=run_probe)
    ps = zsub.add_parser("probe-sets", help="how a target reads image sets: answers and each set hop, teacher-forced",
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

    def run_probe_sets(args):
        _threads(args)
        from research.set_probe import probe_sets_cli

        return probe_sets_cli(args)

    ps.set_defaults(func=run_probe_sets)
    pc = zsub.add_parser("probe-content", help="where an image set's colours and shapes survive, layer by layer",
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

    def run_probe_content(args):
        _threads(args)
        from research.content_probe import probe_content_cli

        return probe_content_cli(args)

    pc.set_defaults(func=run_probe_content)
    pch = zsub.add_parser("probe-charts", help="where a target's heads look when it answers a chart question",
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

    def run_probe_charts(args):
        _threads(args)
        from research.chart_probe import probe_charts_cli

        return probe_charts_cli(args)

    pch.set_defaults(func=run_probe_charts)
    ln = zsub.add_parser("lane", help="keep a training lane in the repository as a small delta, and bring it back",
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
    ln.set_defaults(func=lambda a: __import__("research.lanes", fromlist=["x"]).lane_cli(a))
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
    sp.set_defaults(func=lambda a: __import__("specula.training.target.splice", fromlist=["x"]).splice_cli(a))
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
    rf.set_defaults(func=lambda a: __import__("specula.training.target.refit", fromlist=["x"]).refit_cli(a))
    x = zsub.add_parser("export", help="copy a training checkpoint into the shipped zoo (fp16) and update the manifest")
    x.add_argument("--ckpt", default="runs/target/ckpt", help="checkpoint directory (default: runs/target/ckpt)")
    x.add_argument("--out", default=None,
                   help="target directory to write instead of the shipped one (its parent gets the manifest), e.g. "
                        "runs/zoo-next/target to stage a candidate and train drafters on it with --target")
    x.set_defaults(func=lambda a: __import__("specula.training.build", fromlist=["x"]).export_cli(a))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the distributed runtime on Ray Serve (vision encoder, drafter, verifier, ingress)",
                       description="Start (or join) Ray, deploy the Serve application described by --config and block "
                                   "until interrupted.")
    from specula.runtime.serve.launch import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=lambda a: __import__("specula.runtime.serve.launch", fromlist=["x"]).serve_cli(a))


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="ask a running server one question over its gRPC API",
                       description="A small client of the public gRPC API (specula.runtime.api_client): prints the answer "
                                   "as it is generated.")
    p.add_argument("question", help="what to ask; '<image>' marks where each image goes (default: images first)")
    p.add_argument("--image", action="append", default=[], help="image file (PNG/JPEG/WebP), repeatable")
    p.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC API (default: 127.0.0.1:50051)")
    p.add_argument("--token", default=None, help="API key (default: the SPECULA_API_KEY environment variable)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the answer as it is generated (default); --no-stream waits for the whole answer")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (the server's default)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (server default: 64)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same answer)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system CA roots unless --ca-cert)")
    p.add_argument("--ca-cert", default=None, help="PEM file of the CA that signed the server's certificate")
    p.add_argument("--stats", action="store_true", help="print finish reason, tokens and tau to stderr at the end")
    p.set_defaults(func=lambda a: __import__("specula.runtime.api_client", fromlist=["x"]).chat_cli(a))


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specula",
        description="Specula: lossless speculative decoding for vision-language models. "
                    "Run `specula <command> --help` for each command.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_world(sub)
    _add_bench(sub)
    _add_train(sub)
    _add_zoo(sub)
    _add_serve(sub)
    _add_chat(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"specula: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
