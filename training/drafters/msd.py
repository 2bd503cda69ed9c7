"""``specula train msd``: the MSD head (decoupled visual tokens) with MSD's two-stage recipe (Lin et al. 2025, 4.2).

Data (``training/drafters/distill_data.py``, resumable, the target's own greedy answers, as for ``eagle``):
    D_text  ``text_samples`` text-only conversations of the world's training split (the ``text`` suite)
    D_vis   ``data_samples`` prompts of the world's training mix without its text-only entry (every one has images)
    eval    ``eval_samples`` held-out prompts of the evaluation suites (all of them, text included)

Training: the EAGLE loss, loop, checkpoints and evaluation (``training/drafters/eagle.py``: ``fit``, ``losses``), with
the head reading the raw visual embeddings at image positions (``MsdHead``) and this order of samples:

    stage 1   samples 0 .. S1 - 1: D_text only (language modelling)
    stage 2   S2 = total - S1 samples; the k-th is drawn from D_vis with share k / S2 and from D_text otherwise:
              D_mix(t) = D_text (T - t) / T + D_vis t / T  (eq. 10)

Choices the paper leaves open, made here:
- Eq. 10's epochs become samples: the share grows continuously (per sample, not per epoch) from 0 to 1. The draw is
  deterministic (no coin flips): sample k of stage 2 is visual iff floor(k (k+1) / 2 S2) > floor(k (k-1) / 2 S2),
  i.e. the number of visual samples so far is the integral of the share; any window of stage 2 holds visual
  samples in proportion to its mean share, and half of stage 2 is visual in all.
- S1 = ``stage1_fraction`` of ``total_samples`` (default 1/3: stage 2, where the evaluation's multimodal
  distribution is learned, gets twice stage 1's compute). One warmup + cosine learning-rate schedule over both
  stages (the paper: cosine, stages not specified), so the ablations below run the same schedule.
- Each data set is read in seeded epochs of its own; stage 2 continues D_text's order where stage 1 left it.
- Ablations (each a full recipe run of the same length): ``decoupled=False`` (without decoupling: the EAGLE
  treatment of visual positions, same two-stage data); ``stage1=False`` (without stage 1: all samples in stage 2,
  the progressive mix from the first sample).

Checkpoints resume exactly (the sample order is a pure function of the sample counter); a checkpoint refuses a run
whose recipe differs (``resume_key``). ``export_msd``: fp16 ``msd.safetensors`` + ``msd_config.json`` (which records
``decoupled``) + ``specula.json``.

    cfg = MsdTrainConfig(run_dir="runs/msd", target="target")
    export_msd(train(cfg), out=Path("zoo/weights/msd"))
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specula.training.drafters.common import data_count
from specula.training.drafters.distill_data import Answer, load_answers
from specula.drafters.msd_head import MsdHead
from specula.training.drafters.eagle import (EagleTrainConfig, common_cli_config, epoch_order, export_head, fit,
                                         new_head, open_run)
from specula.zoo.store import ZOO_DIR

MSD_DIR = ZOO_DIR / "msd"
_VISION_SALT = 7_919  # the visual set's epoch orders are seeded apart from the text set's


@dataclass(frozen=True)
class MsdTrainConfig(EagleTrainConfig):
    """``EagleTrainConfig`` (``data_samples`` is D_vis here) plus MSD's data and stages."""

    run_dir: str = "runs/msd"
    text_samples: int = 10_000  # D_text: answers to text-only conversations
    stage1_fraction: float = 1 / 3  # share of total_samples in stage 1 (text only)
    stage1: bool = True  # False: the "without stage 1" ablation
    decoupled: bool = True  # False: the "without decoupling" ablation
    data_dir: str | None = None  # where the answers live (default <run_dir>/data); ablation runs may share one

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.text_samples, bool) or not isinstance(self.text_samples, int) or self.text_samples < 1:
            raise ValueError(f"MsdTrainConfig.text_samples must be an integer >= 1, got {self.text_samples!r}")
        f = self.stage1_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"MsdTrainConfig.stage1_fraction must be in [0, 1), got {f!r}")
        for name in ("stage1", "decoupled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MsdTrainConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.total_samples - self.stage1_samples < 1:
            raise ValueError("MsdTrainConfig.total_samples leaves no stage 2 sample")

    @property
    def stage1_samples(self) -> int:
        return round(self.total_samples * self.stage1_fraction) if self.stage1 else 0

    def resume_key(self) -> dict:
        """What a checkpoint's recipe must share with a run that resumes it (the sample order depends on all)."""
        return {k: getattr(self, k) for k in ("total_samples", "data_samples", "text_samples", "stage1_fraction",
                                              "stage1", "decoupled", "seed")}


# ------------------------------------------------------------------------------------------------------- schedule


def vision_share(t: float, T: float) -> float:
    """Eq. 10: the share of D_vis in stage 2's mix after t of its T samples (0 at the start, 1 at the end)."""
    return min(max(t / T, 0.0), 1.0)


def vision_before(k: int, T: int) -> int:
    """D_vis samples among stage 2's first k (of T): floor of the integral of the share, floor(k (k - 1) / 2T)."""
    return k * (k - 1) // (2 * T)


@dataclass(frozen=True)
class Schedule:
    """Which data set and which of its samples the j-th training sample comes from (module docstring)."""

    total: int
    stage1: int  # samples in stage 1

    def stage(self, j: int) -> int:
        return 1 if j < self.stage1 else 2

    def share(self, j: int) -> float:
        """The D_vis share of the mix at sample j (0 in stage 1)."""
        return 0.0 if j < self.stage1 else vision_share(j - self.stage1, self.total - self.stage1)

    def source(self, j: int) -> tuple[str, int]:
        """("text" | "vision", how many samples of that set were drawn before this one)."""
        if j < self.stage1:
            return "text", j
        k, T = j - self.stage1, self.total - self.stage1
        v = vision_before(k, T)
        if vision_before(k + 1, T) > v:
            return "vision", v
        return "text", self.stage1 + k - v


# ------------------------------------------------------------------------------------------------------- training


def train(cfg: MsdTrainConfig, log=print, stop_at: int | None = None) -> Path:
    """Make D_text, D_vis and the held-out answers (resumable), then train both stages (resumable); returns the
    checkpoint folder. ``stop_at``: stop with a checkpoint once that many samples are done."""
    run = open_run(cfg, log)
    ckpt = run.dir / "ckpt"
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())["config"]
        theirs = {k: old.get(k) for k in cfg.resume_key()}
        if theirs != cfg.resume_key():
            raise ValueError(f"{ckpt} was trained with {theirs}; this run asks for {cfg.resume_key()}: use another "
                             f"run_dir")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else run.dir / "data"
    quiet = lambda _m: None  # noqa: E731  (the counts were logged as the answers were made)
    run.answers(cfg, data_dir, n=cfg.text_samples, split="text", desc="msd data (text)", log=log)
    run.answers(cfg, data_dir, split="vision", desc="msd data (vision)", log=log)
    text = load_answers(data_dir, "text", data_count(run.source, "text", cfg.text_samples, quiet))
    vision = load_answers(data_dir, "vision", data_count(run.source, "vision", cfg.data_samples, quiet))
    held_out = load_answers(data_dir, "eval", data_count(run.source, "eval", cfg.eval_samples, quiet))
    if not text or not vision:
        raise ValueError(f"msd trains on text-only and image prompts both; the data has {len(text)} text-only and "
                         f"{len(vision)} with images")

    head = new_head(MsdHead, run, cfg, decoupled=cfg.decoupled)
    sched = Schedule(cfg.total_samples, cfg.stage1_samples)
    orders: tuple[dict, dict] = ({}, {})

    def pick(j: int) -> Answer:
        src, i = sched.source(j)
        if src == "text":
            return text[epoch_order(i, len(text), cfg.seed, orders[0])]
        return vision[epoch_order(i, len(vision), cfg.seed + _VISION_SALT, orders[1])]

    def status(samples: int) -> dict:
        j = min(samples, cfg.total_samples - 1)
        return {"stage": sched.stage(j), "vision_share": round(sched.share(j), 3)}

    about = (f"{len(text)} text + {len(vision)} multimodal answers, stage 1: {sched.stage1} samples, stage 2: "
             f"{cfg.total_samples - sched.stage1}, decoupled: {cfg.decoupled}")
    return fit(cfg, run, head, pick, held_out, log=log, stop_at=stop_at, about=about, status=status)


def export_msd(ckpt: Path, out: Path = MSD_DIR) -> Path:
    """Checkpoint -> ``out``: fp16 ``msd.safetensors`` + ``msd_config.json`` + ``specula.json`` (with the recipe's
    stages and ablation flags). Rewrites the zoo manifest when ``out`` is in the zoo."""
    state = json.loads((Path(ckpt) / "state.json").read_text())
    c = state["config"]
    cfg = MsdTrainConfig(**{k: v for k, v in c.items() if k in MsdTrainConfig.__dataclass_fields__})
    info = {"text_samples": cfg.text_samples, "stage1_samples": cfg.stage1_samples,
            "stage2_samples": cfg.total_samples - cfg.stage1_samples, "decoupled": cfg.decoupled,
            "stage1": cfg.stage1}
    return export_head(ckpt, out, MsdHead, info)


def ablation_suffix(decoupled: bool, stage1: bool) -> str:
    """"" for MSD, "-no-decouple", "-no-stage1" or "-no-decouple-no-stage1" for the ablations."""
    return ("" if decoupled else "-no-decouple") + ("" if stage1 else "-no-stage1")


def train_msd_cli(args) -> int:
    """``specula train msd``: the shared recipe args (run_dir, target, data_samples = D_vis, samples, max_new_tokens,
    seed, threads, device, ckpt_every, eval_every, export, out) plus text_samples (None = data_samples),
    stage1_fraction, no_stage1, no_decouple, data_dir (None = <run_dir>/data). An ablation flag with the default
    run_dir ("runs/msd") trains in runs/msd<suffix> on runs/msd/data and exports to zoo/weights/msd<suffix>
    (suffix "-no-decouple" / "-no-stage1")."""
    decoupled, stage1 = not args.no_decouple, not args.no_stage1
    suffix = ablation_suffix(decoupled, stage1)
    base = common_cli_config(args)
    data_dir = args.data_dir
    if suffix and base["run_dir"] == "runs/msd":
        base["run_dir"] = f"runs/msd{suffix}"
        data_dir = data_dir or "runs/msd/data"
    text_samples = args.text_samples if args.text_samples is not None else args.data_samples
    cfg = MsdTrainConfig(**base, text_samples=text_samples, stage1_fraction=args.stage1_fraction, stage1=stage1,
                         decoupled=decoupled, data_dir=data_dir)
    ckpt = train(cfg)
    if args.export:
        out = Path(args.out) if args.out else ZOO_DIR / f"msd{suffix}"
        print(f"exported to {export_msd(ckpt, out)}")
    return 0

