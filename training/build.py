"""``specula zoo build`` and ``zoo export``: regenerate the shipped zoo from seeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specula.zoo import store as manifest
from specula.zoo.store import TARGET_DIR, TOKENIZER_DIR


def build_tokenizer(out: Path = TOKENIZER_DIR, seed: int = 0, n_samples: int = 20_000):
    from specula.targets.processor import build_processor
    from specula.world.tokenizer import train_tokenizer

    tok = train_tokenizer(out, vocab_size=1024, n_samples=n_samples, seed=seed)
    build_processor(tok).save_pretrained(out)
    return tok


def export(ckpt: Path, out: Path = TARGET_DIR, tokenizer_dir: Path = TOKENIZER_DIR) -> Path:
    """Checkpoint (fp32 safetensors + state.json) -> a ``from_pretrained`` directory with fp16 weights."""
    from safetensors.torch import load_file

    from specula.targets.processor import load_processor
    from specula.targets.embedded_arch import TargetArch, build_model

    state = json.loads((ckpt / "state.json").read_text())
    processor = load_processor(tokenizer_dir)
    processor.number_images = bool(state["config"].get("number_images", False))  # saved in processor_config.json
    model = build_model(TargetArch.from_name(state["config"]["arch"]), processor.tokenizer)
    model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    model.tie_weights()
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.float16).save_pretrained(out)
    processor.save_pretrained(out)
    # record training facts beside the weights; the config keeps fp32 as the compute dtype
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    info = {
        "kind": "target", "arch": state["config"]["arch"], "params": sum(p.numel() for p in model.parameters()),
        "trained_samples": state["samples"], "train_minutes": round(state["elapsed_s"] / 60, 1),
        "history": state["history"], "storage_dtype": "float16",
    }
    (out / "specula.json").write_text(json.dumps(info, indent=1) + "\n")
    manifest.write(out.parent)
    return out


def export_cli(args) -> int:
    out = export(Path(args.ckpt), Path(args.out) if args.out else TARGET_DIR)
    print(f"exported {args.ckpt} -> {out}")
    return 0


def _refit_stage(cfg: dict, tokenizer_dir: Path) -> None:
    """A recipe "refit" stage: ``cfg["from"]``'s checkpoint copied into ``cfg["run_dir"]``/ckpt with its projector
    refitted (training/target/refit.py). A copy left by an interrupted build is replaced (the refit is quick and has no state)."""
    from specula.training.target.refit import refit_projector

    out = Path(cfg["run_dir"]) / "ckpt"
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    refit_projector(Path(cfg["from"]), out, cfg["cell_codes"], images=cfg["projector_fit_images"],
                    gate=cfg["projector_fit_gate"], tokenizer_dir=tokenizer_dir)


def build_cli(args) -> int:
    """Tokenizer, the target's stages up to ``--until`` (default: the shipped target's last), its export, then every
    drafter (``training/recipe.py``), into ``--zoo-dir`` (default: the shipped zoo); ``--drafters-only``: just the
    drafters, against the target already in the zoo. Rerunning the same command resumes: finished steps are
    skipped, a stage under way continues from its last checkpoint; a drafter the zoo already holds for its target
    is skipped even when the run directory is gone."""
    from specula.training.drafters.commands import run_train_argv
    from specula.training.drafters.distill_data import target_fingerprint
    from specula.targets.processor import load_processor
    from specula.training import recipe
    from specula.training.promote import drafter_problem
    from specula.training.target.train import TrainConfig, train

    zoo = Path(args.zoo_dir) if args.zoo_dir else TARGET_DIR.parent
    runs = Path(args.run_dir)
    if args.skip_drafters and args.drafters_only:
        raise ValueError("--skip-drafters and --drafters-only exclude each other")
    drafters = [] if args.skip_drafters else list(recipe.DRAFTERS)
    only = getattr(args, "drafter", None) or []
    unknown = sorted(set(only) - {d.name for d in recipe.DRAFTERS})
    if unknown:
        raise ValueError(f"--drafter {', '.join(unknown)}: not in the recipe "
                         f"(drafters: {', '.join(d.name for d in recipe.DRAFTERS)})")
    if only:
        drafters = [d for d in drafters if d.name in only]
    stages = [] if args.drafters_only else list(recipe.stages_until(args.until or recipe.SHIPPED_UNTIL))
    steps = (0 if args.drafters_only else 2 + len(stages)) + len(drafters)
    target = zoo / TARGET_DIR.name
    if args.drafters_only and not (target / "config.json").exists():
        raise FileNotFoundError(f"--drafters-only trains against the zoo's target, and {target} has none")
    warm = Path(args.warm_from) if getattr(args, "warm_from", None) else None
    if warm is not None and not warm.is_dir():
        raise FileNotFoundError(f"--warm-from {warm}: no such zoo directory")
    if not 0 < getattr(args, "warm_share", 1.0) <= 1:
        raise ValueError(f"--warm-share must be in (0, 1], got {args.warm_share}")
    if args.dry_run:
        for st in stages:
            cfg = recipe.stage_config(st, runs, args.scale, args.arch, args.threads, args.seed)
            print(f"target stage {st.name} ({st.kind}): " + json.dumps(cfg, sort_keys=True))
        for d in drafters:
            print("specula " + " ".join(recipe.drafter_argv(d, target, zoo, runs, args.scale, args.arch,
                                                            args.threads, args.seed, warm, args.warm_share)))
        return 0
    torch.set_num_threads(args.threads)
    runs.mkdir(parents=True, exist_ok=True)
    marks = runs / "recipe.json"
    done: list[str] = json.loads(marks.read_text())["done"] if marks.exists() else []

    def mark(step: str) -> None:
        done.append(step)
        marks.write_text(json.dumps({"done": done}, indent=1) + "\n")

    i = 0
    if not args.drafters_only:
        tok_dir = zoo / TOKENIZER_DIR.name
        print(f"[1/{steps}] tokenizer")
        build_tokenizer(tok_dir, seed=args.seed, n_samples=args.tokenizer_samples)
        processor = load_processor(tok_dir)
        for i, st in enumerate(stages, 2):
            if st.name in done:
                print(f"[{i}/{steps}] target stage {st.name}: done")
                continue
            print(f"[{i}/{steps}] target stage {st.name} (resumable: rerun the same command to continue)")
            cfg = recipe.stage_config(st, runs, args.scale, args.arch, args.threads, args.seed)
            if st.kind == "refit":
                _refit_stage(cfg, tok_dir)
            else:
                train(TrainConfig(**cfg), processor)
            mark(st.name)
        i = 2 + len(stages)
        print(f"[{i}/{steps}] export the target -> {export(runs / stages[-1].run / 'ckpt', target, tok_dir)}")
    fingerprint = target_fingerprint(target) if drafters else ""
    for i, d in enumerate(drafters, i + 1):
        argv = recipe.drafter_argv(d, target, zoo, runs, args.scale, args.arch, args.threads, args.seed, warm,
                                   args.warm_share)
        if f"drafter:{d.name}" in done:
            print(f"[{i}/{steps}] drafter {d.name}: done")
            continue
        if drafter_problem(zoo / d.name, fingerprint, int(argv[argv.index("--samples") + 1])) is None:
            print(f"[{i}/{steps}] drafter {d.name}: done (exported in the zoo for this target)")
            mark(f"drafter:{d.name}")
            continue
        print(f"[{i}/{steps}] drafter {d.name}: specula {' '.join(argv)}")
        rc = run_train_argv(argv)
        if rc:
            return rc
        mark(f"drafter:{d.name}")
    manifest.write(zoo)
    return 0
