"""The drafter training commands, ``specula train text_lm | eagle | msd | massv | flash | aasd``: each one's
parser beside a handler that imports its trainer only when it runs, so ``--help`` stays free of torch.

``add_drafter_parsers`` mounts them under a ``train`` sub-parser (the ``specula`` CLI does); ``run_train_argv`` runs
one ``["train", KIND, ...]`` argv without the CLI, as ``specula zoo build`` runs the recipe's drafters
(training/recipe.py ``drafter_argv``).
"""

from __future__ import annotations

import argparse

KINDS = ("text_lm", "eagle", "msd", "massv", "flash", "aasd")


def add_drafter_parsers(tsub) -> None:
    """One sub-parser per drafter kind on ``tsub`` (the ``train`` group's sub-parsers), each with its handler."""
    x = tsub.add_parser("text_lm", help="distil the text-only drafter LM from the target's own answers (resumable)",
                        description="Stage 1 asks the target (with the images) for greedy answers on the training "
                                    "prompts (the world's, or --data's rendered with the target's chat template) and "
                                    "keeps its top-k log-probs; stage 2 trains a small LM over the target's tokenizer "
                                    "on each prompt as the served drafter reads it: the target's prompt tokens with "
                                    "the image tokens dropped. --answers data trains on the file's answers instead "
                                    "(plain cross-entropy: no target log-probs). Both stages resume from --run-dir.")
    _distill_args(x, "text_lm", data=30_000, samples=240_000)
    x.add_argument("--arch", default="embedded", choices=["embedded", "tiny"],
                   help="size of a fresh Llama drafter over the target's vocabulary (embedded: 2 layers, d256; tiny: "
                        "for tests); unused with --init-lm")
    x.add_argument("--init-lm", default=None, metavar="DIR",
                   help="train this small causal LM (a transformers AutoModelForCausalLM directory with its "
                        "tokenizer, which must be the target's or a prefix of it) instead of a fresh --arch Llama "
                        "(default: fresh)")
    x.set_defaults(func=_run_text_lm)

    e = tsub.add_parser("eagle", help="train the EAGLE head on the target's hidden states (resumable)",
                        description="Stage 1 caches the target's greedy answers on world training prompts; stage 2 "
                                    "trains one decoder layer over fc(concat(embedding, hidden)) with SmoothL1 on the "
                                    "next hidden state + cross-entropy through the frozen lm_head.")
    _init_from_arg(e, "eagle")
    _distill_args(e, "eagle", data=10_000, samples=60_000)
    e.set_defaults(func=_run_eagle)

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
    m.set_defaults(func=_run_msd)

    mv = tsub.add_parser("massv", help="train the MASSV drafter: a small LM + its own projector over the target's "
                                       "vision features; projector pretraining, then SDViT (resumable)",
                         description="Phase 1 trains only the projector (LM frozen) on image-caption pairs: the "
                                     "world's, or with --data your file's image prompts and their answers; phase 2 "
                                     "(SDViT) fine-tunes projector + LM on the target's own sampled answers to visual "
                                     "instructions (--data-samples prompts, temperatures 0 / 0.7 / 1, top-p 0.9). "
                                     "--no-sdvit: phase 2 on the world's reference answers instead (the paper's "
                                     "ablation; with the default --run-dir trains in runs/massv-no-sdvit and exports "
                                     "to zoo/weights/massv-no-sdvit); with --data, --answers data (or --no-sdvit) "
                                     "trains phase 2 on your file's answers. --samples counts phase 2, "
                                     "--pretrain-samples phase 1.")
    _distill_args(mv, "massv", data=10_000, samples=40_000)
    mv.add_argument("--pretrain-samples", type=int, default=20_000,
                    help="phase 1: caption samples seen while pretraining the projector (default: 20000)")
    mv.add_argument("--init-lm", default="text_lm",
                    help="the LM to start from: a zoo name or directory of a small Llama causal LM saved with the "
                         "target's tokenizer (or a prefix of it); 'none' = a fresh --arch LM over the target's "
                         "vocabulary. The default text_lm is the embedded zoo LM: for a target with another "
                         "tokenizer (LLaVA-1.5, Qwen2.5-VL) a fresh --arch LM is used instead, and logged "
                         "(default: text_lm)")
    mv.add_argument("--arch", default="embedded", choices=["embedded", "tiny"],
                    help="size of a fresh LM (--init-lm none, or the default text_lm on another tokenizer): embedded "
                         "= 2 layers of 256, tiny = 1 layer of 32 for tests (default: embedded)")
    mv.add_argument("--feature", default="pre_projector", choices=["pre_projector", "projected"],
                    help="which target features the projector reads (default: pre_projector, as MASSV)")
    mv.add_argument("--no-sdvit", action="store_true",
                    help="ablation: phase 2 on reference answers (the world's, or --data's) instead of the target's")
    mv.add_argument("--text-every", type=int, default=0,
                    help="every n-th phase-2 sample is the target's answer to a text-only conversation (data_samples "
                         "/ n of them; with --data at most the file's text-only prompts), so the LM keeps plain "
                         "text (default: 0 = none)")
    mv.set_defaults(func=_run_massv)

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
    f.set_defaults(func=_run_flash)

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
    a_.set_defaults(func=_run_aasd)


def _init_from_arg(p, kind: str) -> None:
    """``--init-from``, for the drafters whose trainer can warm-start from an export."""
    p.add_argument("--init-from", default=None,
                   help=f"warm start: an exported {kind} head (a zoo name or directory) of the same config to start "
                        "from instead of a fresh one, e.g. the shipped one when the target was fine-tuned further; "
                        "ignored when --run-dir already has a checkpoint (default: fresh; training/drafters/warm_start.py)")


def _distill_args(p, kind: str, data: int, samples: int) -> None:
    """Arguments shared by the drafter recipes that distil from the target's own answers."""
    p.add_argument("--run-dir", default=f"runs/{kind}", help=f"data, checkpoints and log (default: runs/{kind})")
    p.add_argument("--target", default="target",
                   help="zoo entry or checkpoint directory of the target (a LLaVA-1.5 or Qwen2.5-VL one of yours); "
                        "prompts are rendered with its own processor and chat template (default: target)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="your conversations, LLaVA-Instruct / ShareGPT4V format (a JSON list or JSONL; "
                        "docs/training-data.md): one training prompt per assistant turn, the last records held out; "
                        "every record is checked before anything trains (default: the embedded world's prompts)")
    p.add_argument("--image-root", default=None, metavar="DIR",
                   help="where --data's image paths resolve (default: the data file's folder)")
    p.add_argument("--answers", default="target", choices=["target", "data"],
                   help="what the drafter learns to predict: 'target' = the target's own greedy answers to each "
                        "prompt (self-distillation, as the papers train; default), 'data' = the file's answers")
    p.add_argument("--data-samples", type=int, default=data,
                   help=f"target answers to distil from; with --data at most the file's prompts (default: {data})")
    p.add_argument("--samples", type=int, default=samples, help=f"training samples in all (default: {samples})")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest target answer kept (default: 96)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--ckpt-every", type=float, default=240.0, help="seconds between checkpoints")
    p.add_argument("--eval-every", type=float, default=600.0, help="seconds between held-out evaluations")
    p.add_argument("--export", action="store_true", help="when done, export into the zoo (or --out)")
    p.add_argument("--out", default=None, help=f"export directory (default: zoo/weights/{kind})")


def _run_text_lm(args) -> int:
    from specula.training.drafters.text_lm import train_text_lm_cli

    return train_text_lm_cli(args)


def _run_eagle(args) -> int:
    from specula.training.drafters.eagle import train_eagle_cli

    return train_eagle_cli(args)


def _run_msd(args) -> int:
    from specula.training.drafters.msd import train_msd_cli

    return train_msd_cli(args)


def _run_massv(args) -> int:
    from specula.training.drafters.massv import train_massv_cli

    return train_massv_cli(args)


def _run_flash(args) -> int:
    from specula.training.drafters.flash import train_flash_cli

    return train_flash_cli(args)


def _run_aasd(args) -> int:
    from specula.training.drafters.aasd import train_aasd_cli

    return train_aasd_cli(args)


def train_parser() -> argparse.ArgumentParser:
    """``specula train KIND ...`` for the drafter kinds alone: the parser ``run_train_argv`` reads with."""
    parser = argparse.ArgumentParser(prog="specula", description="Train one drafter of the embedded family.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a drafter (resumable)")
    add_drafter_parsers(train.add_subparsers(dest="train_cmd", required=True))
    return parser


def run_train_argv(argv: list[str]) -> int:
    """Run one drafter's training command, ``["train", KIND, flag, ...]``; returns its exit status."""
    args = train_parser().parse_args(argv)
    return int(args.func(args) or 0)
