"""``specula zoo build`` / ``export`` / ``train target``: regenerate the shipped zoo from seeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specula.zoo import manifest
from specula.zoo.paths import TARGET_DIR, TOKENIZER_DIR


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
    from specula.zoo.target_config import TargetArch, build_model

    state = json.loads((ckpt / "state.json").read_text())
    processor = load_processor(tokenizer_dir)
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


def train_config_from_args(args):
    """The TrainConfig that ``specula train target``'s flags describe."""
    from specula.zoo.train_target import TrainConfig

    return TrainConfig(run_dir=args.run_dir, arch=args.arch, total_samples=args.samples, seed=args.seed,
                       threads=args.threads, ckpt_every_s=args.ckpt_every, eval_every_s=args.eval_every,
                       init_from=args.init_from, vision_images=args.vision_images, mix=args.mix, lr=args.lr,
                       token_budget=args.token_budget, user_loss=args.user_loss, aux_out=args.aux_out,
                       code_lm_samples=args.code_lm_samples, code_lm_layers=args.code_lm_layers,
                       code_lm_lr=args.code_lm_lr, code_token_budget=args.code_token_budget, vision_lr=args.vision_lr,
                       referent_attention=args.referent_attention, vision_from=args.vision_from, lm_from=args.lm_from,
                       caption_referents=args.caption_referents,
                       code_lm_mix=args.code_lm_mix, vision_pos_lr_mult=args.vision_pos_lr_mult,
                       vision_place_weight=args.vision_place_weight, freeze_vision=args.freeze_vision,
                       freeze_projector=args.freeze_projector, tower_lr_mult=args.tower_lr_mult,
                       projector_fit_images=args.projector_fit_images,
                       projector_fit_gate=args.projector_fit_gate,
                       background_code=args.background_code,
                       code_background_noise=args.code_background_noise)


def train_target_cli(args) -> int:
    from specula.targets.processor import load_processor
    from specula.zoo.train_target import train

    cfg = train_config_from_args(args)
    ckpt = train(cfg, load_processor(TOKENIZER_DIR))
    if args.export:
        print(f"exported to {export(ckpt)}")
    return 0


def build_cli(args) -> int:
    """Tokenizer, then the target, into ``--zoo-dir`` (default: the shipped zoo). Rerunning resumes training."""
    from specula.targets.processor import load_processor
    from specula.zoo.train_target import TrainConfig, train

    torch.set_num_threads(args.threads)
    zoo = Path(args.zoo_dir) if args.zoo_dir else TARGET_DIR.parent
    tok_dir = zoo / TOKENIZER_DIR.name
    print("1/2 tokenizer")
    build_tokenizer(tok_dir, seed=args.seed, n_samples=args.tokenizer_samples)
    print("2/2 target (resumable: rerun the same command to continue)")
    cfg = TrainConfig(run_dir=str(Path(args.run_dir) / "target"), arch=args.arch, total_samples=args.samples,
                      seed=args.seed, threads=args.threads, vision_images=args.vision_images)
    ckpt = train(cfg, load_processor(tok_dir))
    print(f"exported to {export(ckpt, zoo / TARGET_DIR.name, tok_dir)}")
    manifest.write(zoo)
    return 0
