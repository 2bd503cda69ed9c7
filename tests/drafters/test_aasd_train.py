"""``specula train aasd`` on a tiny random LLaVA target saved to a temporary directory: Target-Draft Attention
reproduces inference drafting exactly (every chain start and depth), the recipe lowers the loss, resumes exactly,
exports fp16 weights that load back and draft through the engine (image prompts, output unchanged). Nothing is
written into the zoo."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from trainer_kit import (answer_requests, assert_drafts_like_plain, assert_export_loads, assert_loss_falls,
                         assert_resumes_exactly, save_lively_target, zoo_listing)
from transformers import DynamicCache

from specula.drafters import create
from specula.drafters.aasd_head import AasdConfig, AasdHead, context_kv, load_aasd
from specula.training.drafters.distill_data import load_answers, pixels
from specula.training.drafters.aasd import (AasdTrainConfig, aasd_step, context_batch, export_aasd, target_kv,
                                         tda_hidden, train, train_aasd_cli)
from specula.training.drafters.eagle import collate
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "aasd")


def config(tmp_path, target_dir, name: str, **kw) -> AasdTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=16, eval_samples=4,
                max_new_tokens=10, chunk=8, total_samples=64, pool=16, token_budget=4096, warmup_samples=8,
                lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9, kv_tokens=16, train_depth=3)
    return AasdTrainConfig(**{**base, **kw})


def _random_head(target) -> AasdHead:
    head = AasdHead(AasdConfig.from_target(target, kv_tokens=16))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings()).eval()


def test_target_draft_attention_reproduces_chain_drafting(tmp_path, target_dir):
    """For answers with images, tda_hidden at depth j and position t equals the draft drafting from scratch: the
    target's cache of the first s = t - j + 1 tokens (a forward over them alone, images compressed) as context, then
    its own K/V of tokens s .. t, causal, at positions s .. t."""
    cfg = config(tmp_path, target_dir, "tda", total_samples=1)
    train(cfg, log=lambda m: None)  # only for its answers
    target = load_target(target_dir)
    processor = load_processor(TOKENIZER_DIR)
    image = target.info.image_token_id
    answers = [x for x in load_answers(tmp_path / "tda" / "data", "train", 16) if (x.prompt == image).any()][:2]
    batch = collate(answers, processor, cfg.seed, processor.tokenizer.pad_token_id)
    head = _random_head(target)
    _, K, V = target_kv(target.model, batch, "cpu")
    lengths = batch.attention_mask.sum(1).tolist()
    kc, vc, src = context_batch(head, batch.input_ids, lengths, K, V)
    checked = 0
    with torch.no_grad():
        for j in (1, 3):
            h = tda_hidden(head, batch.input_ids, batch.attention_mask.bool(), kc, vc, src, j)  # [B, L, H]
            for b, x in enumerate(answers):
                seq = torch.cat([x.prompt, x.response])
                for t in range(len(x.prompt) + j - 1, len(seq) - 1, 2):
                    s = t - j + 1
                    out = target.model.model(input_ids=seq[None, :s], pixel_values=pixels(processor, x, cfg.seed),
                                             use_cache=True).past_key_values.layers[-1]
                    k, v, _ = context_kv(head, seq[:s], out.keys[0], out.values[0])  # [H_kv, S, D]
                    cache = DynamicCache(config=head.llama_config)
                    cache.update(k[None], v[None], 0)
                    n = t - s + 1
                    allowed = torch.cat([torch.ones(n, k.shape[1], dtype=torch.bool),
                                         torch.ones(n, n, dtype=torch.bool).tril()], 1)[None, None]
                    ref = head(seq[None, s:t + 1], torch.arange(s, t + 1)[None], allowed, cache)[0, -1]
                    torch.testing.assert_close(h[b, t], ref, atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked >= 8


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    cfg = config(tmp_path, target_dir, "a")
    straight = config(tmp_path, target_dir, "b", data_dir=str(tmp_path / "a" / "data"))
    ckpt, a = assert_resumes_exactly(train, cfg, straight, 32)  # interrupted at 32, resumed
    assert {"w_k", "w_v", "norm.weight", "layer.self_attn.q_proj.weight"} <= a.keys()

    # the head started from the target's last layer; the loss went down on the answers it trained on
    target = load_target(target_dir)
    processor = load_processor(TOKENIZER_DIR)
    answers = load_answers(tmp_path / "a" / "data", "train", 16)
    torch.manual_seed(cfg.seed)
    head = AasdHead(AasdConfig.from_target(target, kv_tokens=16))  # train()'s init
    head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    head.init_from_target(target.model)
    last = target.model.model.language_model.layers[-1].self_attn.q_proj.weight
    assert torch.equal(head.layer.self_attn.q_proj.weight, last)
    assert_loss_falls(head, a, target, processor, answers, cfg, step=aasd_step)
    assert (a["w_k"] != AasdHead(head.config).w_k).any()  # the KV projector trained away from pooling
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 64 and state["history"][-1]["eval_tau_g4"] >= 1.0

    # export (fp16) and load back, with the target (shared lm_head) and without
    out = export_aasd(ckpt, tmp_path / "zoo" / "aasd")
    info, _ = assert_export_loads(out, "aasd", load_aasd, target, a)
    assert info["kv_tokens"] == 16 and info["train_depth"] == 3

    # drafts through the engine from the exported directory on image prompts, output unchanged
    image = target.info.image_token_id
    imgs = [x for x in answers if (x.prompt == image).any()][:3]
    reqs = answer_requests(processor, imgs, cfg.seed)
    d = create({"kind": "aasd", "path": str(out)}, target=target)
    assert_drafts_like_plain(target_dir, target, d, reqs, 5, [processor.tokenizer.eos_token_id])


def test_cli_trains_and_exports(tmp_path, target_dir):
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=6, samples=6,
                              max_new_tokens=6, seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9,
                              export=True, out=str(tmp_path / "out" / "aasd"), kv_tokens=4, train_depth=2,
                              data_dir=None)
    zoo = zoo_listing()
    assert train_aasd_cli(args) == 0
    cfg = json.loads((tmp_path / "out" / "aasd" / "aasd_config.json").read_text())
    assert cfg["kv_tokens"] == 4 and cfg["image_tokens"] == 144
    assert zoo_listing() == zoo  # the zoo is untouched


def test_specula_train_aasd_is_wired():
    from specula.cli import build_parser

    args = build_parser().parse_args(["train", "aasd", "--kv-tokens", "32", "--train-depth", "4"])
    assert args.kv_tokens == 32 and args.train_depth == 4 and args.run_dir == "runs/aasd" and args.func


@pytest.mark.parametrize("field,value", [("kv_tokens", 0), ("train_depth", 0), ("init_from_target", 1),
                                         ("lr", 0.0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        AasdTrainConfig(**{field: value})
