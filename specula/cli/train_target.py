"""``specula train target``'s flags and handler, as they were in the one-file CLI.

The flags name ``TrainConfig``'s fields (training/target/train.py) one by one, and ``train_config_from_args`` in
training/build.py maps them back; ``specula/cli/train.py`` mounts this parser under ``train``.
"""

from __future__ import annotations

import argparse

# world/suites.py MIXES, named here so that --help does not import the world (a test keeps the two equal)
MIX_NAMES = ["base", "dialogue", "lookup", "scenes", "describe", "confusable", "scenes_confusable", "confusable_scan",
             "scan_captions", "colour_captions", "scan_suites", "scan_multi", "scan_multi_odd",
             "scan_suites_count", "scan_suites_sets", "scan_suites_charts", "scan_placed", "scan_placed_multi"]

HELP = "train the embedded LLaVA target from scratch on the world (resumes from run-dir)"


def add_train_target_arguments(t: argparse.ArgumentParser) -> None:
    """Every ``train target`` flag on ``t``, and its handler."""
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
    t.set_defaults(func=train_target_cli)


def train_target_cli(args) -> int:
    """Train (or resume) the target the flags describe; ``--export`` ships it when done."""
    from specula.training.build import train_target_cli as run

    return run(args)
