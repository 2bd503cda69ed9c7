"""The shipped zoo's recipe, as data: the target's stages and every drafter's training command, in order.

``specula zoo build`` runs it (``training/build.py``): tokenizer, then the target's stages (each a ``TrainConfig``; a
stage resumes or skips in its run directory), the target's export, then each drafter's ``specula train`` command
against that export. The numbers are those of the runs that made the shipped weights (docs/embedded-model.md, "The
target"; how the recipe was found: zoo/TRAINING.md); ``scale`` multiplies every sample / image count, for a quick
small build (tests use ``arch="tiny"``).

The target, in these run directories:

1. ``lm``: the LM alone on word codes (training/target/word_codes.py) with hard-negative scene dialogues, 2 layers trained, cut
   at 22,944 samples of a 40,000-sample schedule; then 4 layers on the ``confusable`` mix to the schedule's end.
2. ``tower``: tower + projector on dense patch labels with the place head, 100,000 images, the gated projector fit;
   extended to 116,000 and 180,000 images with the fitted projector held fixed (each extension refits it).
3. ``target``: the merge (the LM of 1, the tower and fitted projector of 2), then a short joint stage in which the
   tower moves at 1/20 of the LM's rate through the fixed projector.
4. ``direct`` and ``cells`` (zoo/TRAINING.md, "A direct route"): from 3's weights (rounded to fp16 as
   the first export stored them) one pool of scan captions with the vision side frozen, for a training checkpoint;
   the projector refitted with a code per layout cell (training/target/refit.py) into ``cells``; then frozen-vision training on
   the ``scan_suites`` mix, on the schedules the runs had (50,000 cut at 13,680, 27,000 cut at 24,864, 40,000);
   then a second cycle in ``cycle2``: the same stage from 4.'s last checkpoint (rounded to fp16, fresh optimizer
   with a short re-warm-up) on a 90,000-sample schedule, so its rate climbs back to ~1.9e-4 and decays again;
   its checkpoint at 55,008 samples was shipped as a target of its own (``--until cycle-2``).
5. ``reader`` and ``finish`` (the image-set lanes, zoo/TRAINING.md): from 4.'s checkpoint (rounded
   to fp16) the set terms on the image-sets mix at 6e-4 on an 80,000-sample schedule, with numbered images; at
   57,888 the count head's keys and query fitted (training/target/set_count_fit.py), at 60,576 its number read out, cut at
   63,456 (lane ``reader-b``); then from that checkpoint (rounded to fp16) the same terms on the ``scan_suites`` mix
   to 73,296 (lane ``finish-a``). The lane itself also ran two short variants left out here (576 samples with the
   odd hops a layer lower, a code path since removed, and 2,016 samples of consistency on two layers) and made the
   count fit twice (first without the query steps); its threads changed between runs, so the recipe walks its route
   rather than reproducing its bits.
6. counting and charts (their lanes, zoo/TRAINING.md): ``finish`` goes on with the count read out as
   a number on the counting mix, on a 100,000-sample schedule, to 80,448 (lane ``bcount``); from that checkpoint
   (rounded to fp16) ``count`` runs the odd-one-out mix to 87,504 and the counting mix to 93,696. Then the tower
   learns the chart words (training/target/chart_words.py) in four legs of the vision stage, each followed by the projector's
   refit: ``parts`` to 200,000 images at 3e-4 and 260,000 at 5e-4 (2,400 LM samples between), ``whole`` to 290,000
   and 305,000; the LM trains on the charts mix with the chart lookups (training/target/chart_referents.py) to 105,984 (lane
   ``cw``). ``readout`` goes on from there (rounded to fp16) with the lookup head's readout of value answers
   (training/target/chart_readout.py), at weight 1 and then 5 on a 150,000-sample schedule, cut at 145,056. The lane's first
   readout (every lookup answer, 106,368-111,168) was a code path since removed, so the recipe reads values from the
   start.
``SHIPPED_UNTIL`` names the last stage of the shipped target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# fields every stage of the word-code recipe shares
_CODES = dict(code_lm_samples=40_000, code_lm_layers=4, code_lm_mix="confusable", referent_attention=1.0)
_VISION = dict(vision_place_weight=1.0, projector_fit_images=960, projector_fit_gate=True)
_LM = dict(total_samples=0, mix="dialogue", token_budget=2048, lr=3e-4, aux_out=0.0, vision_images=0,
           code_lm_lr=1e-3, code_token_budget=1024, eval_every_s=300.0, **_CODES)
_TOWER = dict(total_samples=0, mix="dialogue", code_lm_samples=1, code_lm_layers=2, code_lm_mix="scenes",
              referent_attention=1.0, vision_lr=1e-3, vision_pos_lr_mult=30.0, eval_every_s=1e5, **_VISION)

# the direct route's stages (4.): vision side frozen, scan listings' object cells weighted, no auxiliary losses
_DIRECT = dict(freeze_vision=True, tower_lr_mult=0.02, aux_out=0.0, vis_weight=0.0, lr=3e-4, mix="scan_suites",
               object_cell_weight=3.0, vision_images=180_000, **_VISION, **{**_CODES, "referent_attention": 0.0})

# the image-set stages (5.): the direct route's flags at twice its rate on the 80,000-sample schedule of the lanes,
# numbered images (`Image n: `), and the set terms (training/target/set_referents.py, set_isolation.py, set_count.py)
_SETS = dict(number_images=True, set_referents=10.0, set_marks=1.0, set_hops="reader", set_readout=1.0,
             set_isolation=10.0, set_consistency=30.0, set_consistency_layers=1, set_odd=10.0, set_count=10.0,
             set_count_readout=3.0)
_READER = {**_DIRECT, **_SETS, "lr": 6e-4, "total_samples": 80_000, "mix": "scan_multi_odd", "token_budget": 1024}
_COUNT_FIT = dict(set_count_key_fit=200, set_count_query_steps=200)
# the counting and chart stages (6.): the finishing flags with the count read out as a number, on the 100,000-sample
# schedule of lane bcount; then the chart words (training/target/chart_words.py), the chart lookups and their readout
_COUNTING = {**_READER, "set_count_number_readout": 3.0, "total_samples": 100_000, "mix": "scan_suites_count"}
_CHARTS = {**_COUNTING, "total_samples": 120_000, "mix": "scan_suites_charts", "chart_referents": 3.0,
           "chart_words": "whole", "vision_images": 305_000, "vision_lr": 5e-4}
# the set and chart terms that train or read a hop on a layer / head (training/target/train.py _check_hops_fit): a 2-layer
# tiny LM lacks some of those layers, so a tiny build runs these stages without them
HOP_TERMS = ("set_referents", "set_marks", "set_readout", "set_odd", "set_count", "set_count_readout",
             "set_count_number_readout", "set_count_key_fit", "set_count_query_steps", "chart_referents",
             "chart_readout")

# what a tiny test build changes besides the counts: small pools and batches, no mid-run checks, and no gate on
# the projector fit (a tower trained on a few dozen images does not separate objects from background)
TINY = dict(pool=4, token_budget=2048, code_token_budget=2048, warmup_samples=4, eval_n=1, eval_every_s=1e9,
            ckpt_every_s=1e9, projector_fit_gate=False)

# TrainConfig fields that count samples or images (scaled by ``scale``)
COUNTS = ("total_samples", "code_lm_samples", "code_lm_stop", "vision_images", "projector_fit_images", "stop_at")


@dataclass(frozen=True)
class TargetStage:
    name: str
    run: str  # run directory (under the build's --run-dir); stages of one directory go on from each other
    config: dict  # TrainConfig fields; for a "refit" stage: cell_codes, projector_fit_images, projector_fit_gate
    needs: dict = field(default_factory=dict)  # TrainConfig field (a refit's "from") -> run dir whose ckpt it names
    kind: str = "train"  # "train": a TrainConfig run; "refit": needs["from"]'s ckpt copied into ``run`` with its
    #                      projector refitted with cell codes (training/target/refit.py)


TARGET_STAGES = (
    TargetStage("lm-2-layers", "lm", {**_LM, "code_lm_layers": 2, "code_lm_mix": "scenes_confusable",
                                       "code_lm_stop": 22_944}),
    TargetStage("lm-4-layers", "lm", _LM),
    TargetStage("tower-100k", "tower", {**_TOWER, "vision_images": 100_000}),
    TargetStage("tower-116k", "tower", {**_TOWER, "vision_images": 116_000}),
    TargetStage("tower-180k", "tower", {**_TOWER, "vision_images": 180_000}),
    TargetStage("merge", "target", {"total_samples": 0, "vision_images": 180_000, **_VISION, **_CODES},
                needs={"lm_from": "lm", "vision_from": "tower"}),
    TargetStage("joint", "target", {"total_samples": 4_500, "freeze_projector": True, "tower_lr_mult": 0.05,
                                    "aux_out": 0.0, "lr": 1e-4, "mix": "confusable", "vision_images": 180_000,
                                    **_VISION, **_CODES}),
    TargetStage("captions", "direct", {**_DIRECT, "total_samples": 50_000, "stop_at": 4_560, "mix": "scan_captions"},
                needs={"init_from": "target"}),
    TargetStage("cell-codes", "cells", {"cell_codes": 1.0, "projector_fit_images": 960, "projector_fit_gate": True},
                needs={"from": "direct"}, kind="refit"),
    TargetStage("suites-50k", "cells", {**_DIRECT, "total_samples": 50_000, "stop_at": 13_680}),
    TargetStage("suites-27k", "cells", {**_DIRECT, "total_samples": 27_000, "stop_at": 24_864}),
    TargetStage("suites-40k", "cells", {**_DIRECT, "total_samples": 40_000}),
    TargetStage("cycle-2", "cycle2", {**_DIRECT, "total_samples": 90_000, "stop_at": 55_008},
                needs={"init_from": "cells"}),  # cut where that shipped target was taken
    TargetStage("reader", "reader", {**_READER, "stop_at": 57_888}, needs={"init_from": "cycle2"}),
    TargetStage("reader-fit", "reader", {**_READER, **_COUNT_FIT, "stop_at": 60_576}),
    TargetStage("reader-number", "reader", {**_READER, **_COUNT_FIT, "set_count_number_readout": 3.0,
                                            "stop_at": 63_456}),
    TargetStage("finish", "finish", {**_READER, "set_count_number_readout": 3.0, "mix": "scan_suites",
                                     "stop_at": 73_296}, needs={"init_from": "reader"}),
    TargetStage("count", "finish", {**_COUNTING, "stop_at": 80_448}),  # lane bcount: finish-a's run goes on
    TargetStage("sets", "count", {**_COUNTING, "mix": "scan_suites_sets", "stop_at": 87_504},
                needs={"init_from": "finish"}),
    TargetStage("count-2", "count", {**_COUNTING, "stop_at": 93_696}),
    # the tower learns the chart words in four legs, each refitting the projector after it (zoo/TRAINING.md, "Chart
    # reading words")
    TargetStage("chart-parts", "count", {**_CHARTS, "chart_words": "parts", "vision_images": 200_000,
                                         "vision_lr": 3e-4, "stop_at": 93_696}),
    TargetStage("chart-parts-2", "count", {**_CHARTS, "chart_words": "parts", "vision_images": 260_000,
                                           "stop_at": 96_768}),
    TargetStage("chart-whole", "count", {**_CHARTS, "vision_images": 290_000, "stop_at": 96_768}),
    TargetStage("chart-whole-2", "count", {**_CHARTS, "stop_at": 105_984}),  # lane cw
    TargetStage("chart-readout", "readout", {**_CHARTS, "chart_readout": 1.0, "stop_at": 112_320},
                needs={"init_from": "count"}),
    TargetStage("chart-readout-150k", "readout", {**_CHARTS, "chart_readout": 1.0, "total_samples": 150_000,
                                                  "stop_at": 118_752}),
    TargetStage("chart-readout-5", "readout", {**_CHARTS, "chart_readout": 5.0, "total_samples": 150_000,
                                               "stop_at": 145_056}),  # cut where the candidate was taken
)
# The shipped target is the export of this stage's run; stages after it would be a candidate under way
# (zoo/candidates, training/promote.py, zoo/TRAINING.md): ``specula zoo build --until <stage>`` builds those too, and
# ``--until`` an earlier stage builds an earlier target (``joint``: an earlier shipped target).
SHIPPED_UNTIL = "chart-readout-5"


def stages_until(name: str) -> tuple[TargetStage, ...]:
    """The target's stages up to and including ``name``."""
    names = [st.name for st in TARGET_STAGES]
    if name not in names:
        raise ValueError(f"no target stage {name!r} (stages: {', '.join(names)})")
    return TARGET_STAGES[:names.index(name) + 1]


@dataclass(frozen=True)
class DrafterStep:
    name: str  # zoo entry it exports
    argv: tuple[str, ...]  # ``specula train`` arguments after the kind; {run} {zoo} expand, counts scale
    kind: str = ""  # ``specula train`` kind (default: name)


DRAFTERS = (  # in dependency order: massv starts from text_lm; flash / aasd / the msd ablations reuse cached data
    DrafterStep("text_lm", ("--data-samples", "4000", "--samples", "80000")),
    DrafterStep("eagle", ("--data-samples", "3000", "--samples", "12000")),
    DrafterStep("msd", ("--data-samples", "3000", "--text-samples", "1500", "--samples", "36000")),
    DrafterStep("flash", ("--data-dir", "{run}/eagle/data", "--data-samples", "3000", "--samples", "14000")),
    DrafterStep("aasd", ("--data-dir", "{run}/eagle/data", "--data-samples", "3000", "--samples", "32000")),
    DrafterStep("massv", ("--init-lm", "{zoo}/text_lm", "--data-samples", "4000", "--pretrain-samples", "6000",
                          "--samples", "32000", "--text-every", "5")),
    DrafterStep("msd-no-decouple", ("--no-decouple", "--data-dir", "{run}/msd/data", "--data-samples", "3000",
                                    "--text-samples", "1500", "--samples", "36000"), kind="msd"),
    DrafterStep("msd-no-stage1", ("--no-stage1", "--data-dir", "{run}/msd/data", "--data-samples", "2000",
                                  "--text-samples", "1500", "--samples", "12000"), kind="msd"),
    DrafterStep("massv-no-sdvit", ("--no-sdvit", "--init-lm", "{zoo}/text_lm", "--data-samples", "4000",
                                   "--pretrain-samples", "6000", "--samples", "32000", "--text-every", "5"),
                kind="massv"),
)
WARM_KINDS = ("eagle", "msd", "flash", "aasd")  # the kinds whose trainers take --init-from (training/drafters/warm_start.py)
_COUNT_FLAGS = {"--data-samples", "--text-samples", "--samples", "--pretrain-samples"}


def scaled(n: int, scale: float) -> int:
    """A count at ``scale``: 0 stays 0, anything else keeps at least 4 so that every stage still runs."""
    return n if scale == 1.0 or n == 0 else max(4, round(n * scale))


def stage_config(stage: TargetStage, run_dir: Path, scale: float = 1.0, arch: str = "embedded", threads: int = 2,
                 seed: int = 0) -> dict:
    """The TrainConfig fields of one stage of a build under ``run_dir``."""
    cfg = dict(stage.config)
    for k in COUNTS:
        if k in cfg:
            cfg[k] = scaled(cfg[k], scale)
    if stage.kind == "refit":
        if arch == "tiny":
            cfg["projector_fit_gate"] = False  # as TINY: a few dozen images do not separate objects from background
        return {**cfg, "from": str(run_dir / stage.needs["from"] / "ckpt"), "run_dir": str(run_dir / stage.run)}
    if cfg.get("code_lm_stop", 0) >= cfg.get("code_lm_samples", 0) > 0:  # a small scale: keep the stop inside
        cfg["code_lm_stop"] = cfg["code_lm_samples"] // 2
    if arch == "tiny":  # 2 decoder layers: the 2- and 4-layer stages become 1 and 2
        cfg.update(TINY)
        cfg.update({k: 0 for k in HOP_TERMS if k in cfg})
        cfg["code_lm_layers"] = cfg.get("code_lm_layers", 0) // 2
    for k, run in stage.needs.items():
        cfg[k] = str(run_dir / run / "ckpt")
    return {**cfg, "run_dir": str(run_dir / stage.run), "arch": arch, "threads": threads, "seed": seed}


def warm_source(step: DrafterStep, warm_from: Path | None) -> Path | None:
    """The exported drafter a build warm-starts ``step`` from (``--warm-from``): ``warm_from/<name>`` when its kind
    can warm-start (``WARM_KINDS``) and that directory holds an export; None = train it fresh."""
    if warm_from is None or (step.kind or step.name) not in WARM_KINDS:
        return None
    src = Path(warm_from) / step.name
    return src if (src / "specula.json").exists() else None


def drafter_argv(step: DrafterStep, target: Path, zoo: Path, run_dir: Path, scale: float = 1.0,
                 arch: str = "embedded", threads: int = 2, seed: int = 0, warm_from: Path | None = None,
                 warm_share: float = 1.0) -> list[str]:
    """The full ``specula train`` argv of one drafter of a build; with ``warm_from`` (``warm_source``) it starts from
    that export and trains ``warm_share`` of its ``--samples`` (its cached answers are as many as ever)."""
    args = [a.format(run=run_dir, zoo=zoo) for a in step.argv]
    warm = warm_source(step, warm_from)
    for i, a in enumerate(args[:-1]):
        if a in _COUNT_FLAGS:
            n = scaled(int(args[i + 1]), scale)
            args[i + 1] = str(max(1, round(n * warm_share)) if warm is not None and a == "--samples" else n)
    kind = step.kind or step.name
    out = ["train", kind, "--run-dir", str(run_dir / step.name), "--target", str(target), *args,
           "--threads", str(threads), "--seed", str(seed), "--export", "--out", str(zoo / step.name)]
    if warm is not None:
        out += ["--init-from", str(warm)]
    if arch == "tiny" and kind == "text_lm":
        out += ["--arch", "tiny"]
    return out
