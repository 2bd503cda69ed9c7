"""``TrainConfig``: every setting of a target training run, each with its default and its help.

The one definition of each setting: ``specula train target`` derives its flags from these fields
(training/target/cli.py), the recipe's stages name them (training/recipe.py), and a run records them in its
checkpoint's ``state.json``. Imports nothing heavy, so building the CLI's parser stays quick.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SET_HOP_NAMES = ("deep", "shallow", "reader")  # set_referents.py SET_HOPS' keys (a test keeps them equal)
CHART_WORD_LEVELS = ("parts", "whole")  # training/target/chart_words.py's levels


def setting(default, help: str, **cli):
    """A field with its help; ``cli``: how its flag differs from the plain one (``flag``: another name, ``choices``,
    ``const``: the value of the flag given alone)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = setting("runs/target", "checkpoints and log go here; an existing run resumes")
    arch: str = setting("embedded", "model size (tiny, tiny_deep: for tests)",
                        choices=("embedded", "tiny", "tiny_deep"))
    total_samples: int = setting(
        60_000, "training samples of the joint stage in all: its learning-rate schedule ends there", flag="--samples")
    pool: int = setting(48, "samples drawn at a time, sorted by length and split into token-budget micro-batches")
    token_budget: int = setting(4096, "tokens per optimizer step (rows x longest row); smaller budgets give more "
                                      "updates for the same compute")
    lr: float = setting(1e-3, "peak learning rate of the joint stage (warm-up, then cosine decay to a tenth)")
    projector_lr_mult: float = setting(3.0, "the projector's learning rate as a multiple of --lr")
    warmup_samples: int = setting(2_000, "samples of linear warm-up (a run started from other weights, with a fresh "
                                         "optimizer, re-warms over a quarter of them)")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    aux_in: float = setting(0.5, "weight of the dense loss on the projector outputs: each visual token, read through "
                                 "the LM's final norm and tied lm_head, should say the words of the object under its "
                                 "patch (with word codes: the squared distance to its patch's code)")
    aux_out: float = setting(0.25, "weight of the same dense patch-word loss on the LM's last hidden state at the "
                                   "image positions; 0 = off")
    curriculum: float = setting(0.15, "share of the schedule drawn mostly from single-object questions and short "
                                      "captions before the full mix (--mix base only)")
    seed: int = setting(0, "seed of the model's initialisation, the data stream and the word codes")
    ckpt_every_s: float = setting(240.0, "seconds between checkpoints", flag="--ckpt-every")
    stop_at: int = setting(0, "stop with a checkpoint once the run reaches this many samples, keeping the "
                              "learning-rate schedule of --samples (a later run with a higher --stop-at or none goes "
                              "on from there); 0 = run to --samples")
    eval_every_s: float = setting(600.0, "seconds between image-vs-blank checks", flag="--eval-every")
    eval_n: int = setting(48, "held-out questions per image-vs-blank check")
    threads: int = setting(2, "torch CPU threads")
    vision_images: int = setting(4_000, "stage 0: images for the tower + projector stage before joint training; "
                                        "raising it on a resumed run trains the vision stage further before joint "
                                        "training goes on")
    vision_lr: float | None = setting(None, "learning rate of the vision stage (unset: --lr)")
    vision_pos_lr_mult: float = setting(1.0, "learning-rate multiplier of the vision tower's position embeddings in "
                                             "the vision stage. They start far quieter than the patch content; without "
                                             "a boost the tower barely learns where a patch is")
    vision_place_weight: float = setting(0.0, "vision stage: weight of a dense head that reads each patch's 3 x 3 "
                                              "layout cell (VisionHeads.place); 0 = no head. Colour and shape can be "
                                              "read from a bag of patches; this head makes the tower carry where each "
                                              "patch is to its last layer")
    freeze_vision: bool = setting(False, "joint stage: keep the tower and projector as the vision stage and projector "
                                         "fit left them; only the LM trains")
    tower_lr_mult: float = setting(1.0, "joint stage: the vision tower's learning rate as a multiple of --lr. A tower "
                                        "aligned to the word codes drifts off them at the LM's rate")
    freeze_projector: bool = setting(False, "joint stage: keep the projector (and the background gate of "
                                            "--projector-fit-gate) as the fit left it; the tower and the LM train, the "
                                            "LM's gradient reaching the tower through it")
    projector_fit_images: int = setting(0, "word-code recipe: after the vision stage, fit the projector in closed form "
                                           "(ridge regression of the codes on the tower's features) on this many "
                                           "images, once per run and again whenever a resumed run extends the vision "
                                           "stage; 0 = off, 960 is plenty (training/target/projector_fit.py)")
    projector_fit_gate: bool = setting(False, "with --projector-fit-images: also gate background patches to exact "
                                              "zeros (a closed-form object/background score closes every hidden unit "
                                              "of the projector there)")
    vis_weight: float = setting(0.5, "joint stage: weight of the dense vision-head loss on the tower's features; 0 = "
                                     "off, e.g. after --init-from, whose vision heads start untrained")
    init_from: str | None = setting(None, "exported weights (e.g. zoo/weights/target) or a run's ckpt directory to "
                                          "start from when --run-dir has no checkpoint; with the word-code flags the "
                                          "code LM, vision and projector-fit stages count as done and only the joint "
                                          "stage runs (the vision heads start fresh: see --vis-weight)")
    mix: str = setting("base", "training mix (world/suites.py MIXES): base (one question per sample), dialogue "
                               "(12-turn scene dialogues per image, ~10x the grounded answers per forward), lookup "
                               "(mostly scenes described in words, as dialogues), scenes (almost only scene "
                               "dialogues), describe (dialogue with twice the scene captions), confusable (describe "
                               "plus dialogues about scenes whose objects share colours and shapes), scenes_confusable "
                               "(scenes plus those dialogues), confusable_scan (confusable with scene captions that "
                               "name all nine cells in reading order), scan_captions (confusable_scan with twice the "
                               "captions), colour_captions (scan_captions with the captions listed by colour), "
                               "scan_suites (scan_captions plus dialogues about charts, image sets and clips), "
                               "scan_multi (scan_suites with image sets at about a third of the samples, their "
                               "captions worded \"Image N has ...\"), scan_multi_odd (scan_multi plus sets with an odd "
                               "one out, about one sample in eight), scan_suites_count (scan_suites plus sets built "
                               "for counting, their counts drawn evenly, about one sample in ten), scan_suites_sets "
                               "(scan_suites_count plus sets with an odd one out, about one sample in twelve), "
                               "scan_suites_charts (scan_suites_count with twice the chart dialogues), scan_placed "
                               "(scan_suites with half the prompts asked with text or the question before the image, "
                               "or after a system turn) or scan_placed_multi (scan_multi placed the same way)")
    object_cell_weight: float = setting(1.0, "loss weight on the word that opens a scan listing's object cell ('top, "
                                             "a ...': the 'a'), against the 'no object' verdicts that make up two "
                                             "cells in three; 1 = off (training/target/cell_weights.py)")
    code_lm_samples: int = setting(0, "word-code recipe (training/target/word_codes.py): samples of a first stage in "
                                      "which the LM alone learns the world with fixed word codes in place of the image "
                                      "tokens; the vision stage then regresses tower + projector onto the codes; 0 = "
                                      "off. Raising it on a resumed run extends the stage, until the joint stage has "
                                      "begun")
    code_lm_layers: int = setting(0, "train only the first N decoder layers in the code LM stage, then start the "
                                     "others as identities; 0 = all layers")
    code_lm_lr: float = setting(1e-3, "peak learning rate of the code LM stage")
    code_token_budget: int = setting(1024, "tokens per optimizer step in the code LM stage (small batches, many "
                                           "updates)")
    code_lm_mix: str = setting("dialogue", "training mix of the code LM stage (the names of --mix)")
    code_lm_stop: int = setting(0, "end the code LM stage at this many samples, on --code-lm-samples' schedule, "
                                   "unfinished: a later run of the same directory (e.g. with more --code-lm-layers) "
                                   "goes on; 0 = off")
    referent_attention: float = setting(0.0, "weight of the referent-attention loss in the LM stages "
                                             "(training/target/referents.py): for each lookup question, head 0 of "
                                             "layer 0 attends to the question's referent words and head 0 of layer 1 "
                                             "to the referent's image tokens; 0 = off")
    vision_from: str | None = setting(None, "a run's ckpt directory: a fresh run starts its tower, projector and "
                                            "vision heads from it and counts its vision images as done, and its "
                                            "projector fit when it has one (same seed and arch, both word-code runs)")
    lm_from: str | None = setting(None, "a word-code run's ckpt directory whose code LM stage is done and whose joint "
                                        "stage has not begun: a fresh run starts its language model and code-stage "
                                        "progress from it. With --vision-from this pairs a code LM with a tower "
                                        "trained elsewhere")
    device: str = setting("cpu", "where the joint stage trains: cpu, cuda or cuda:N. The earlier stages (code LM, "
                                 "vision, projector fit) run on the CPU; a run started with --init-from goes straight "
                                 "to the joint stage")
    max_minutes: float = setting(0.0, "stop the joint stage with a checkpoint after this many minutes of this run, "
                                      "e.g. to fit a lease or a session (rerunning goes on); 0 = no limit")
    set_consistency: float = setting(0.0, "weight of a loss that pulls the hidden states of each image of an image "
                                          "set that does not open its prompt (the second and later images, or a first "
                                          "one after 'Image 1: ') towards the same model's states for that image alone "
                                          "at the start; clips are left out; 0 = off "
                                          "(training/target/set_consistency.py)")
    set_consistency_layers: int = setting(0, "pull only the outputs of the first N decoder layers with "
                                             "--set-consistency, so the layers above stay free to add each image's "
                                             "number (--set-marks); 0 = every layer")
    set_referents: float = setting(0.0, "weight of an attention loss that teaches which image of a set is meant: for "
                                        "each 'which image' question and each 'Image n has ...' caption line, the "
                                        "ordinal hop attends to the ordinal (or the line's number) and the patch hop "
                                        "to that image's object patches (--set-hops); 0 = off "
                                        "(training/target/set_referents.py)")
    set_marks: float = setting(0.0, "weight of an attention loss that gives a set's image tokens their image's number "
                                    "from the prompt: at each object patch of image n, the mark hop (head 2 of layer "
                                    "1, of layer 0 with --set-hops shallow or reader) attends to the number of the "
                                    "'Image n:' marker before it (use with --number-images); 0 = off "
                                    "(training/target/set_referents.py set_mark_targets)")
    number_images: bool = setting(False, "train on prompts whose image sets are numbered ('Image 1: <image> Image 2: "
                                         "<image> ...', added where missing); the exported processor numbers them the "
                                         "same way for every caller (targets/image_marks.py)")
    set_hops: str = setting("deep", "where the set hops sit: deep (ordinal at layer 2, the named image's patches at "
                                    "layer 4, marks at layer 1), shallow (layers 0 and 1, head 0: the heads the scene "
                                    "lookups read colours with; marks at layer 0 head 2) or reader (as shallow with "
                                    "the ordinal on head 4 of layer 0, apart from the scene word hop) "
                                    "(training/target/set_referents.py SET_HOPS)", choices=SET_HOP_NAMES)
    set_isolation: float = setting(0.0, "weight of an attention loss that keeps each later image of a set from "
                                        "reading the images before it: at its object patches, every layer's and "
                                        "head's mass on the earlier images' tokens is penalised; 0 = off "
                                        "(training/target/set_isolation.py)")
    set_readout: float = setting(0.0, "weight of a loss that makes the head of the named image's patch hop say what "
                                      "it sees: at each 'which image' answer and each colour or shape word of an "
                                      "'Image n has ...' caption line, that head's output alone, read through the "
                                      "final norm and LM head, must predict the word (builds the --set-referents "
                                      "targets); 0 = off (training/target/set_readout.py)")
    set_odd: float = setting(0.0, "weight of an attention loss for 'which image is different / the odd one out?' "
                                  "answers: head 3 of layer 1 spread over every image's objects (the set's common "
                                  "look) and head 0 of layer 2 on the odd image's object patches, whose image number "
                                  "(--set-marks) is the answer; 0 = off (training/target/set_referents.py "
                                  "set_odd_targets)")
    set_count: float = setting(0.0, "weight of an attention loss for 'how many images show a ...?' answers: head 3 of "
                                    "layer 0 reads each image's objects onto the token after it, and at the answer "
                                    "head 2 of layer 1 spreads over the first token and those tokens of the images "
                                    "showing the shape, so 1/(m+1) stays on the first token; a set without its 'Image "
                                    "n:' markers gets none (--number-images adds them); 0 = off "
                                    "(training/target/set_count.py)")
    set_count_readout: float = setting(0.0, "weight of a readout loss on --set-count's summary hops: at the token "
                                            "after each image the summary head's own output, read through the LM "
                                            "head, should say the shapes that image shows (so the count hop can match "
                                            "them against the asked shape word); 0 = off "
                                            "(training/target/set_readout.py summary_readout_loss)")
    set_count_number_readout: float = setting(0.0, "weight of a readout loss on --set-count's count hop: at each "
                                                   "counting answer the count head's own output, read through the LM "
                                                   "head, should say the number (builds the count targets); 0 = off "
                                                   "(training/target/set_readout.py count_readout_loss)")
    chart_referents: float = setting(0.0, "weight of an attention loss for chart questions about one part of the "
                                          "chart (a bar's or point's value; the tallest bar, the peak, the largest "
                                          "slice): the scene lookup's hops (head 0 of layer 0 on a bar's colour word, "
                                          "head 0 of layer 1 on the part's patches) and, for a value, head 3 of layer "
                                          "3 on the number printed above the part (with --chart-words: no number hop, "
                                          "the part's own tokens carry its value); needs an LM of 4+ layers and "
                                          "heads; 0 = off (training/target/chart_referents.py)")
    chart_readout: float = setting(0.0, "weight of a readout loss on --chart-referents' lookup: at the answer of a "
                                        "value question (a bar's or point's value), head 0 of layer 1 (the head that "
                                        "finds the asked part), read out alone through the final norm and LM head, "
                                        "must say the value; needs --chart-referents, and --chart-words for the value "
                                        "to be on the part; 0 = off (training/target/chart_readout.py)")
    chart_words: str = setting("", "the word codes of a chart's parts also name what each part shows, so that the "
                                   "vision stage and the projector fit put that on the part's own visual tokens: "
                                   "'parts' (the flag alone) a bar's value and, on the tallest, 'tallest', a line "
                                   "point's ordinal, value and, on the peak, 'highest'; 'whole' also the number of "
                                   "bars or slices on each, 'largest' on the largest slice, and on the last point "
                                   "whether the line ends 'higher' or 'lower'; raise --vision-images on a resumed run "
                                   "to retrain the tower with them; unset = off (training/target/chart_words.py)",
                               choices=CHART_WORD_LEVELS, const="parts")
    set_count_key_fit: int = setting(0, "before the joint stage, once per run: fit what each image of N counting "
                                        "dialogues shows from the count layer's input at its summary token, write the "
                                        "fit into the count head's keys (the slowest rotary pairs) and zero the "
                                        "head's query there, so the count hop's query can learn the match instead of "
                                        "sitting at the saddle of an untrained query and key (needs --set-count or "
                                        "--set-count-readout and --number-images); 0 = off "
                                        "(training/target/set_count_fit.py)")
    set_count_query_steps: int = setting(0, "with --set-count-key-fit: then N Adam steps on the count head's query "
                                            "alone against the count hop's targets on the same dialogues (rotary "
                                            "positions and causal softmax exact), so the joint stage starts with the "
                                            "match in place; 0 = off (training/target/set_count_fit.py)")

    @property
    def uses_codes(self) -> bool:
        return self.code_lm_samples > 0

    @property
    def uses_count_targets(self) -> bool:
        """Some term reads the count targets (training/target/set_count.py)."""
        return self.set_count > 0 or self.set_count_readout > 0 or self.set_count_number_readout > 0

    def __post_init__(self):
        from specula.world.suites import MIXES

        if self.mix not in MIXES or self.code_lm_mix not in MIXES:
            raise ValueError(f"unknown mix {self.mix!r} / {self.code_lm_mix!r} (known: {', '.join(MIXES)})")
        if self.code_lm_samples < 0 or self.code_lm_layers < 0 or self.code_token_budget <= 0:
            raise ValueError("code_lm_samples and code_lm_layers must be >= 0 and code_token_budget > 0")
        if self.referent_attention < 0:
            raise ValueError("referent_attention must be >= 0")
        if self.object_cell_weight <= 0:
            raise ValueError("object_cell_weight must be > 0 (1 = off)")
        if self.stop_at < 0:
            raise ValueError("stop_at must be >= 0 (0 = run to total_samples)")
        if self.set_consistency < 0:
            raise ValueError("set_consistency must be >= 0 (0 = off)")
        if self.set_consistency_layers < 0:
            raise ValueError("set_consistency_layers must be >= 0 (0 = every layer)")
        if self.set_referents < 0:
            raise ValueError("set_referents must be >= 0 (0 = off)")
        if self.set_count_key_fit < 0 or (self.set_count_key_fit and not (
                (self.set_count > 0 or self.set_count_readout > 0) and self.number_images)):
            raise ValueError("set_count_key_fit must be >= 0 and needs the count targets (set_count or "
                             "set_count_readout > 0) on numbered sets (number_images)")
        if self.set_count_query_steps < 0 or (self.set_count_query_steps and not self.set_count_key_fit):
            raise ValueError("set_count_query_steps must be >= 0 and needs set_count_key_fit")
        if self.set_hops not in SET_HOP_NAMES:
            raise ValueError(f"set_hops must be one of {', '.join(SET_HOP_NAMES)}, got {self.set_hops!r}")
        if self.set_marks < 0:
            raise ValueError("set_marks must be >= 0 (0 = off)")
        if self.set_readout < 0 or self.set_isolation < 0 or self.set_odd < 0 or self.set_count < 0:
            raise ValueError("set_readout, set_isolation, set_odd and set_count must be >= 0 (0 = off)")
        if self.chart_referents < 0:
            raise ValueError("chart_referents must be >= 0 (0 = off)")
        if self.chart_readout < 0:
            raise ValueError("chart_readout must be >= 0 (0 = off)")
        if self.chart_readout > 0 and self.chart_referents <= 0:
            raise ValueError("chart_readout reads the head that --chart-referents trains: it needs chart_referents > 0")
        if self.chart_words not in ("", *CHART_WORD_LEVELS):
            raise ValueError(f"chart_words must be '', 'parts' or 'whole', got {self.chart_words!r}")
        if self.set_count_readout < 0:
            raise ValueError("set_count_readout must be >= 0 (0 = off)")
        if self.set_count_number_readout < 0:
            raise ValueError("set_count_number_readout must be >= 0 (0 = off)")
        if self.max_minutes < 0:
            raise ValueError("max_minutes must be >= 0 (0 = no time limit)")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.code_lm_stop < 0 or (self.code_lm_stop and self.code_lm_stop >= self.code_lm_samples):
            raise ValueError("code_lm_stop must be 0 (off) or below code_lm_samples: it cuts the code stage short")
        if self.vision_place_weight < 0:
            raise ValueError("vision_place_weight must be >= 0")
        if self.projector_fit_images < 0 or (self.projector_fit_images and not self.uses_codes):
            raise ValueError("projector_fit_images must be >= 0 and needs the word-code recipe (code_lm_samples > 0)")
        if self.lm_from and not self.uses_codes:
            raise ValueError("lm_from needs the word-code recipe (code_lm_samples > 0): it carries a code LM over")
        if self.projector_fit_gate and not self.projector_fit_images:
            raise ValueError("projector_fit_gate needs projector_fit_images > 0 (it gates the fitted projector)")
