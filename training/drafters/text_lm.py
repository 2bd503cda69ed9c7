"""``specula train text_lm``: distil the text-only drafter from the target's own answers.

Recipe (the text-only drafter of IbED / MASSV):

1. Data. Prompts of the world's training split (``train_stream(seed, start=data_start)``: the TRAIN_MIX weights,
   indices past the target's own training samples). The *target* answers each one greedily, with its images, up to
   EOS or ``max_new_tokens`` (the answers the drafter must predict at temperature 0), and at every answer position
   we keep its top-``topk`` log-probabilities at temperature 1. Written under ``<run_dir>/data/`` as safetensors
   chunks of ``chunk`` samples (written whole, then renamed: a rerun skips the chunks it has), plus
   ``eval.safetensors``: the same for ``eval_samples`` prompts of the evaluation suites. ``data/meta.json`` records
   what defines the answers (settings + sha256 of the target's weights); a rerun that differs is refused.
2. Training. The text LM reads the prompt *with the image tokens removed*, then the answer; on every answer
   position the loss is
       (1 - kd_weight) * CE(the target's greedy token) + kd_weight * soft CE(the target's top-k, renormalized).
   The first term is sequence-level distillation (Kim & Rush 2016): what greedy acceptance needs. The second
   teaches the shape of p, which sampled acceptance (sum of min(p, q)) needs; top-k keeps the files small.
   AdamW, warmup then cosine decay; epochs over the data in a seeded order, a pool of ``pool`` samples at a time,
   split into token-budget batches.
3. Checkpoints: ``<run_dir>/ckpt`` (fp32 safetensors, optimizer via ``torch.save`` loadable with
   ``weights_only=True``, state.json) every ``ckpt_every_s`` seconds and at the end; a rerun resumes, and the data
   order is a pure function of the sample counter, so a resumed run sees the same batches.
   Evaluation on the held-out answers: top-1 agreement with the target and ``tau_g4``, the mean accepted length
   greedy chain drafting with gamma 4 would get on them (exact: with teacher forcing the committed prefix *is* the
   target's greedy output).
4. ``export_text_lm``: fp16 ``save_pretrained`` + the tokenizer + ``specula.json``, then the zoo manifest.

    cfg = TextLMTrainConfig(run_dir="runs/text_lm", target="target")
    export_text_lm(train(cfg), out=Path("zoo/weights/text_lm"))
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specula.training.drafters.distill_data import same_data
from specula.training.drafters.common import Cadence, chunks_to_make, epoch_order, save_checkpoint, warmup_cosine
from specula.zoo import store as manifest
from specula.zoo.store import TOKENIZER_DIR, ZOO_DIR, sibling_ref
from specula.training.drafters.text_lm_config import TextLMArch, build_model, matmul_macs_per_token

TEXT_LM_DIR = ZOO_DIR / "text_lm"
DATA_FORMAT = "specula-text-lm-data/1"
EVAL_SUITES = ("caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text")


@dataclass(frozen=True)
class TextLMTrainConfig:
    run_dir: str = "runs/text_lm"
    target: str = "target"  # zoo name or directory of the target (LlavaForConditionalGeneration)
    tokenizer_dir: str = str(TOKENIZER_DIR)  # processor: tokenizer + image processor
    arch: str = "embedded"  # TextLMArch name
    # data
    data_samples: int = 30_000
    data_start: int = 1_000_000  # first train_stream index (the target trained on 0 .. ~60k)
    eval_samples: int = 192
    max_new_tokens: int = 96  # the world's answers are <= ~80 tokens
    topk: int = 8
    chunk: int = 64  # samples per data file
    gen_batch: int = 16  # prompts per batched target generation
    # training
    total_samples: int = 240_000  # samples seen in all (epochs = total / data)
    pool: int = 256
    token_budget: int = 8192  # rows x longest row per batch
    lr: float = 2e-3
    warmup_samples: int = 4_000
    weight_decay: float = 0.01
    kd_weight: float = 0.5
    seed: int = 0
    ckpt_every_s: float = 240.0
    eval_every_s: float = 600.0
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        TextLMArch.from_name(self.arch)  # ValueError for an unknown name
        positive = ("data_samples", "max_new_tokens", "topk", "chunk", "gen_batch", "total_samples", "pool",
                    "token_budget", "threads")
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TextLMTrainConfig.{name} must be an integer >= 1, got {v!r}")
        for name in ("data_start", "eval_samples", "warmup_samples", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TextLMTrainConfig.{name} must be an integer >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"TextLMTrainConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"TextLMTrainConfig.kd_weight must be in [0, 1], got {self.kd_weight!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"TextLMTrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not (self.ckpt_every_s > 0 and self.eval_every_s > 0):
            raise ValueError("TextLMTrainConfig.ckpt_every_s and eval_every_s must be > 0")

    def data_key(self) -> dict:
        """The fields that define the cached data (with the target's weights): a rerun must not mix files."""
        keys = ("target", "data_start", "max_new_tokens", "topk", "chunk", "seed")
        return {k: getattr(self, k) for k in keys}


# ------------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Example:
    prompt: torch.Tensor  # [Lp] int64, text-only prompt (image tokens removed)
    response: torch.Tensor  # [Lr] int64, the target's greedy answer (EOS included when reached)
    topk_ids: torch.Tensor  # [Lr, k] int64, the target's top-k tokens at each answer position
    topk_logp: torch.Tensor  # [Lr, k] fp32, their log-probabilities (temperature 1)


def _encode(processor, sample):
    """World sample -> (input_ids [L] with image tokens expanded, pixel_values or None)."""
    from specula.world.tokenizer import format_turns

    text = format_turns(sample.prompt, system=sample.system)
    if sample.images:
        enc = processor(text=[text], images=list(sample.images), return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"][0], enc["pixel_values"]
    return processor.tokenizer([text], return_tensors="pt", add_special_tokens=False)["input_ids"][0], None


@torch.no_grad()
def answer_greedy(target, requests, max_new_tokens: int, eos: set[int], k: int):
    """Batched greedy answers with the target's top-k log-probs at every step.

    Returns per request (tokens [Lr] int64, topk_ids [Lr, k] int64, topk_logp [Lr, k] fp32).
    """
    from specula.targets import Accept

    out = target.prefill(requests)
    ids = list(out.request_ids)
    toks = {r: [] for r in ids}
    tk_ids, tk_lp = {r: [] for r in ids}, {r: [] for r in ids}

    def take(rids, logits):  # logits [B, V] fp32
        lp, ti = logits.log_softmax(-1).topk(k, dim=-1)  # [B, k]
        nxt = logits.argmax(-1).tolist()
        for b, r in enumerate(rids):
            toks[r].append(nxt[b])
            tk_ids[r].append(ti[b].cpu())
            tk_lp[r].append(lp[b].cpu())
        target.commit([Accept(r, (), t) for r, t in zip(rids, nxt)])

    try:
        take(ids, out.logits)
        active = ids
        while True:
            done = [r for r in active if toks[r][-1] in eos or len(toks[r]) >= max_new_tokens]
            if done:
                target.release(done)
            active = [r for r in active if r not in done]
            if not active:
                break
            take(active, target.decode_step(active).logits[:, 0])
    finally:
        target.release([r for r in ids if r in target.live_ids])
    return [(torch.tensor(toks[r]), torch.stack(tk_ids[r]), torch.stack(tk_lp[r])) for r in ids]


def _write_examples(path: Path, index: list[int], examples: list[Example], meta: dict) -> None:
    tensors = {
        "index": torch.tensor(index, dtype=torch.long),
        "prompt": torch.cat([e.prompt for e in examples]).to(torch.int32),
        "prompt_len": torch.tensor([len(e.prompt) for e in examples], dtype=torch.long),
        "response": torch.cat([e.response for e in examples]).to(torch.int32),
        "response_len": torch.tensor([len(e.response) for e in examples], dtype=torch.long),
        "topk_ids": torch.cat([e.topk_ids for e in examples]).to(torch.int32),
        "topk_logp": torch.cat([e.topk_logp for e in examples]).to(torch.float16),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": DATA_FORMAT, **{k: str(v) for k, v in meta.items()}})
    tmp.replace(path)


def read_examples(path: Path) -> list[Example]:
    with safe_open(path, "pt") as f:
        if (f.metadata() or {}).get("format") != DATA_FORMAT:
            raise ValueError(f"{path}: not a {DATA_FORMAT} file")
    t = load_file(path)
    out, p0, r0 = [], 0, 0
    for lp, lr in zip(t["prompt_len"].tolist(), t["response_len"].tolist()):
        out.append(Example(t["prompt"][p0:p0 + lp].long(), t["response"][r0:r0 + lr].long(),
                           t["topk_ids"][r0:r0 + lr].long(), t["topk_logp"][r0:r0 + lr].float()))
        p0, r0 = p0 + lp, r0 + lr
    return out


def _make_examples(target, processor, samples, cfg: TextLMTrainConfig, tag: str) -> list[Example]:
    from specula.targets import PrefillRequest

    image_id = target.info.image_token_id
    eos = set(target.info.eos_token_ids) | {processor.tokenizer.eos_token_id}
    encoded = [_encode(processor, s) for s in samples]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))  # similar lengths batch together
    result: list[Example | None] = [None] * len(encoded)
    for g in range(0, len(order), cfg.gen_batch):
        group = order[g:g + cfg.gen_batch]
        reqs = [PrefillRequest(f"{tag}-{i}", *encoded[i]) for i in group]
        for i, (resp, ti, tl) in zip(group, answer_greedy(target, reqs, cfg.max_new_tokens, eos, cfg.topk)):
            ids = encoded[i][0]
            result[i] = Example(ids[ids != image_id], resp, ti, tl)
    return result


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's weight files: cached answers belong to exactly these weights."""
    return hashlib.sha256("".join(manifest.sha256(f) for f in sorted(Path(target_dir).glob("*.safetensors")))
                          .encode()).hexdigest()


def make_data(cfg: TextLMTrainConfig, target, processor, key: dict, log=print) -> Path:
    """Generate (or finish generating) ``<run_dir>/data`` for ``key`` (what defines the answers); returns the
    folder."""
    from specula.world.suites import generate, train_stream

    data = Path(cfg.run_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    meta_path = data / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if not same_data(old, key):
            raise ValueError(f"{data} holds data made with {old}; this run asks for {key}: use another run_dir")
    else:
        meta_path.write_text(json.dumps(key, indent=1) + "\n")
    if not (data / "eval.safetensors").exists() and cfg.eval_samples:
        samples = [generate(EVAL_SUITES[i % len(EVAL_SUITES)], "eval", 20_000 + i, cfg.seed)
                   for i in range(cfg.eval_samples)]
        _write_examples(data / "eval.safetensors", list(range(cfg.eval_samples)),
                        _make_examples(target, processor, samples, cfg, "eval"), key)
    todo, done = chunks_to_make(data, "train", cfg.data_samples, cfg.chunk)
    if done:
        log(f"data: {done} of {cfg.data_samples} target answers already in {data}")
    bar = tqdm(total=cfg.data_samples, initial=done, unit="sample", desc="text_lm data", mininterval=5.0)
    for s in todo:
        n = min(cfg.chunk, cfg.data_samples - s)
        stream = train_stream(seed=cfg.seed, start=cfg.data_start + s)
        samples = [next(stream) for _ in range(n)]
        examples = _make_examples(target, processor, samples, cfg, f"t{s}")
        _write_examples(data / f"train-{s:08d}.safetensors", list(range(s, s + n)), examples, key)
        bar.update(n)
    bar.close()
    return data


def load_data(data: Path, n: int) -> list[Example]:
    """The first ``n`` training examples, in index order."""
    out = []
    for f in sorted(data.glob("train-*.safetensors")):
        out.extend(read_examples(f))
    if len(out) < n:
        raise ValueError(f"{data} holds {len(out)} examples, {n} asked for")
    return out[:n]


# ------------------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, prompt then response, right-padded
    attention_mask: torch.Tensor  # [B, L] int64
    rows: torch.Tensor  # [M] int64, row of each scored position
    cols: torch.Tensor  # [M] int64, input position whose output predicts the token
    target: torch.Tensor  # [M] int64, the target's greedy token
    topk_ids: torch.Tensor  # [M, k] int64
    topk_logp: torch.Tensor  # [M, k] fp32


def collate(items: list[Example], pad_id: int) -> Batch:
    seqs = [torch.cat([e.prompt, e.response]) for e in items]
    ids = torch.full((len(items), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols = [], []
    for b, (e, s) in enumerate(zip(items, seqs)):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
        lp, lr = len(e.prompt), len(e.response)
        rows.append(torch.full((lr,), b, dtype=torch.long))
        cols.append(torch.arange(lp - 1, lp + lr - 1))
    return Batch(ids, mask, torch.cat(rows), torch.cat(cols), torch.cat([e.response for e in items]),
                 torch.cat([e.topk_ids for e in items]), torch.cat([e.topk_logp for e in items]))


def token_budget_batches(items: list[Example], budget: int) -> list[list[Example]]:
    """Group by length so that rows x longest row stays under ``budget`` tokens."""
    items = sorted(items, key=lambda e: len(e.prompt) + len(e.response))
    groups, cur, longest = [], [], 0
    for e in items:
        n = len(e.prompt) + len(e.response)
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(e)
        longest = max(longest, n)
    return groups + ([cur] if cur else [])


def losses(model, batch: Batch, device) -> dict[str, torch.Tensor]:
    """Hard CE on the target's greedy token, soft CE on its renormalized top-k, top-1 agreement."""
    hidden = model.model(input_ids=batch.input_ids.to(device),
                         attention_mask=batch.attention_mask.to(device)).last_hidden_state  # [B, L, H]
    h = hidden[batch.rows.to(device), batch.cols.to(device)]  # [M, H]
    logp = model.lm_head(h).float().log_softmax(-1)  # [M, V]
    tgt = batch.target.to(device)
    teacher = batch.topk_logp.to(device).softmax(-1)  # [M, k] renormalized over the top-k
    return {
        "hard": -logp.gather(1, tgt[:, None]).mean(),
        "soft": -(teacher * logp.gather(1, batch.topk_ids.to(device))).sum(-1).mean(),
        "agree": (logp.argmax(-1) == tgt).float().mean(),
    }


def greedy_tau(agree: list[bool], gamma: int = 4) -> tuple[int, int]:
    """(accepted drafts + blocks, blocks) of greedy chain drafting on one answer, from per-position top-1 agreement;
    their ratio is ``RequestMetrics.tau``.

    The first answer token comes from the target's prefill; each block accepts the drafts up to the first
    disagreement (at most gamma) and adds the target's own token. ``[T, T, F, T]`` with gamma 4 -> (4, 2):
    block 1 accepts answer[1] and the target gives answer[2], block 2 accepts answer[3] (and a bonus token).
    """
    pos, counted, blocks = 1, 0, 0
    while pos < len(agree):
        k = 0
        while k < gamma and pos + k < len(agree) and agree[pos + k]:
            k += 1
        counted, blocks, pos = counted + k + 1, blocks + 1, pos + k + 1
    return counted, blocks


@torch.no_grad()
def evaluate(model, examples: list[Example], pad_id: int, device, budget: int = 8192) -> dict[str, float]:
    was_training = model.training
    model.eval()
    n_tok, hard, agree_n, counted, blocks = 0, 0.0, 0, 0, 0
    for group in token_budget_batches(examples, budget):
        b = collate(group, pad_id)
        hidden = model.model(input_ids=b.input_ids.to(device),
                             attention_mask=b.attention_mask.to(device)).last_hidden_state
        logp = model.lm_head(hidden[b.rows.to(device), b.cols.to(device)]).float().log_softmax(-1)  # [M, V]
        tgt = b.target.to(device)
        hit = (logp.argmax(-1) == tgt).cpu()
        hard += float(-logp.gather(1, tgt[:, None]).sum())
        n_tok, agree_n = n_tok + len(tgt), agree_n + int(hit.sum())
        start = 0
        for e in group:
            em, bl = greedy_tau(hit[start:start + len(e.response)].tolist())
            counted, blocks, start = counted + em, blocks + bl, start + len(e.response)
    model.train(was_training)
    return {"eval_ce": round(hard / max(n_tok, 1), 4), "eval_agree": round(agree_n / max(n_tok, 1), 4),
            "eval_tau_g4": round(counted / max(blocks, 1), 3)}


def lr_at(samples: int, cfg: TextLMTrainConfig) -> float:
    return warmup_cosine(samples, cfg.warmup_samples, cfg.total_samples, cfg.lr)


def _target_info(target) -> dict:
    tc = target.model.config.text_config
    macs = matmul_macs_per_token(tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads,
                                 tc.num_key_value_heads or tc.num_attention_heads, tc.intermediate_size,
                                 tc.vocab_size)
    return {"lm_macs_per_token": macs, "image_token_id": target.info.image_token_id}


def train(cfg: TextLMTrainConfig, log=print) -> Path:
    """Make the data (resumable), then train (resumable); returns the checkpoint folder."""
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    processor = load_processor(cfg.tokenizer_dir)
    tok = processor.tokenizer
    target_dir = resolve(cfg.target)
    target = load_target(target_dir, device=cfg.device)
    key = {**cfg.data_key(), "target_sha256": target_fingerprint(target_dir)}
    data_dir = make_data(cfg, target, processor, key, log)
    tinfo = _target_info(target)
    del target
    data = load_data(data_dir, cfg.data_samples)
    held_out = read_examples(data_dir / "eval.safetensors") if cfg.eval_samples else []

    arch = TextLMArch.from_name(cfg.arch)
    model = build_model(arch, tok, seed=cfg.seed).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    macs = matmul_macs_per_token(arch.hidden, arch.layers, arch.heads, arch.kv_heads, arch.ffn, len(tok))
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg),
             "compute_ratio": round(macs / tinfo["lm_macs_per_token"], 4), "image_token_id": tinfo["image_token_id"],
             "target_sha256": key["target_sha256"]}
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())
        if old["config"]["arch"] != cfg.arch:
            raise ValueError(f"{ckpt} holds a {old['config']['arch']!r} model; this run asks for {cfg.arch!r}")
        model.load_state_dict(load_file(ckpt / "model.safetensors", device=str(cfg.device)), strict=False)
        model.tie_weights()
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=cfg.device))
        state.update({k: old[k] for k in ("samples", "steps", "elapsed_s", "history")})
        log(f"resumed from {ckpt}: {state['samples']} samples, {state['elapsed_s'] / 60:.1f} min")
    log(f"text_lm {cfg.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
        f"{state['compute_ratio']:.3f} of the target LM's matmul compute per token, {len(data)} examples")

    def save() -> None:
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_checkpoint(ckpt, "model.safetensors", sd, opt, state)

    def run_eval() -> None:
        if held_out:
            res = evaluate(model, held_out, tok.pad_token_id, cfg.device, cfg.token_budget)
            res.update(samples=state["samples"], minutes=round(state["elapsed_s"] / 60, 1),
                       **{f"loss_{k}": round(v, 4) for k, v in ema.items()})
            state["history"].append(res)
            log(json.dumps(res))

    model.train()
    perm: dict = {}
    ema: dict[str, float] = {}
    bar = tqdm(total=cfg.total_samples, initial=state["samples"], unit="sample", desc="train text_lm",
               mininterval=5.0)
    clock = Cadence(state, cfg.eval_every_s, cfg.ckpt_every_s)
    while state["samples"] < cfg.total_samples:
        start = state["samples"]
        stop = min(start + cfg.pool, cfg.total_samples)
        items = [data[epoch_order(j, len(data), cfg.seed, perm)] for j in range(start, stop)]
        for group in token_budget_batches(items, cfg.token_budget):
            lr = lr_at(state["samples"], cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            parts = losses(model, collate(group, tok.pad_token_id), cfg.device)
            loss = (1 - cfg.kd_weight) * parts["hard"] + cfg.kd_weight * parts["soft"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["steps"] += 1
            state["samples"] += len(group)
            bar.update(len(group))
            for k, v in parts.items():
                x = float(v.detach())
                ema[k] = 0.98 * ema.get(k, x) + 0.02 * x
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        clock.tick(run_eval, save)
    bar.close()
    run_eval()
    save()
    return ckpt


# ------------------------------------------------------------------------------------------------------- export


def export_text_lm(ckpt: Path, out: Path = TEXT_LM_DIR, tokenizer_dir: Path | str = TOKENIZER_DIR) -> Path:
    """Checkpoint -> a ``from_pretrained`` LlamaForCausalLM directory (fp16 storage, fp32 compute) + specula.json;
    then rewrites the manifest of ``out.parent`` (the zoo, by default)."""
    from transformers import AutoTokenizer

    ckpt, out = Path(ckpt), Path(out)
    state = json.loads((ckpt / "state.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    model = build_model(TextLMArch.from_name(state["config"]["arch"]), tok)
    model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    model.tie_weights()
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.float16).save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"  # stored in fp16, computed in fp32
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    info = {
        "kind": "text_lm", "arch": state["config"]["arch"], "params": sum(p.numel() for p in model.parameters()),
        "compute_ratio": state["compute_ratio"], "image_token_id": state["image_token_id"],
        "distilled_from": sibling_ref(state["config"]["target"], out), "target_sha256": state["target_sha256"],
        "data_samples": state["config"]["data_samples"],
        "trained_samples": state["samples"], "train_minutes": round(state["elapsed_s"] / 60, 1),
        "device": state["config"].get("device", "cpu"),  # what train_minutes were measured on
        "history": state["history"], "storage_dtype": "float16",
    }
    (out / "specula.json").write_text(json.dumps(info, indent=1) + "\n")
    manifest.write(out.parent)
    return out


def train_text_lm_cli(args) -> int:
    """``specula train text_lm``: args run_dir, target, arch, data_samples, samples, max_new_tokens, seed, threads,
    device, ckpt_every, eval_every, export (bool), out (None = zoo/weights/text_lm)."""
    cfg = TextLMTrainConfig(run_dir=args.run_dir, target=args.target, arch=args.arch, data_samples=args.data_samples,
                            total_samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            threads=args.threads, device=args.device, ckpt_every_s=args.ckpt_every,
                            eval_every_s=args.eval_every)
    ckpt = train(cfg)
    if args.export:
        print(f"exported to {export_text_lm(ckpt, Path(args.out) if args.out else TEXT_LM_DIR)}")
    return 0
