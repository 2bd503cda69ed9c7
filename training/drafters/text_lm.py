"""``specula train text_lm``: distil the text-only drafter from the target's own answers.

Recipe (the text-only drafter of IbED / MASSV):

1. Data. Prompts of the world's training split (``train_stream(seed, start=data_start)``: the TRAIN_MIX weights,
   indices past the target's own training samples), or of the user's conversation file (``data_file``,
   ``training/data/sources.py``: one prompt per assistant turn, rendered by the target's own processor and chat
   template, Qwen2.5-VL's ``image_grid_thw`` with it). The *target* answers each one greedily, with its images, up
   to EOS or ``max_new_tokens`` (the answers the drafter must predict at temperature 0), and at every answer
   position we keep its top-``topk`` log-probabilities at temperature 1. ``answers="data"`` (a file only) takes the
   file's own answers instead: there are no target log-probs then, so each position's "top-k" is the data's token
   alone (k = 1, log-prob 0) and the loss below is plain cross-entropy on the data (hard targets).
   Written under ``<run_dir>/data/`` as safetensors chunks of ``chunk`` samples (written whole, then renamed: a
   rerun skips the chunks it has), plus ``eval.safetensors``: the same for ``eval_samples`` held-out prompts (the
   world's evaluation suites, or the file's held-out records). ``data/meta.json`` records what defines the answers
   (settings, the file's sha256 + sha256 of the target's weights); a rerun that differs is refused.
2. Training. The text LM reads the prompt as the served drafter does (``text_view``: the target's prompt ids with
   every image token dropped, ``drafters/text_lm.py`` ``begin``), then the answer; on every answer position the
   loss is
       (1 - kd_weight) * CE(the target's greedy token) + kd_weight * soft CE(the target's top-k, renormalized).
   The first term is sequence-level distillation (Kim & Rush 2016): what greedy acceptance needs. The second
   teaches the shape of p, which sampled acceptance (sum of min(p, q)) needs; top-k keeps the files small.
   The LM is a fresh Llama (``arch``) over the target's tokenizer with one logit per target vocabulary id, or an
   existing causal LM (``init_lm``, any ``AutoModelForCausalLM`` whose tokenizer is the target's or a prefix of it,
   ``drafters/vocab.py``); its logits are cut to the ids it shares with the target, as the served drafter's q is.
   AdamW, warmup then cosine decay; epochs over the data in a seeded order, a pool of ``pool`` samples at a time,
   split into token-budget batches.
3. Checkpoints: ``<run_dir>/ckpt`` (fp32 safetensors + the LM's config.json, optimizer via ``torch.save`` loadable
   with ``weights_only=True``, state.json) every ``ckpt_every_s`` seconds and at the end; a rerun resumes, and the
   data order is a pure function of the sample counter, so a resumed run sees the same batches.
   Evaluation on the held-out answers: top-1 agreement with the target and ``tau_g4``, the mean accepted length
   greedy chain drafting with gamma 4 would get on them (exact: with teacher forcing the committed prefix *is* the
   target's greedy output).
4. ``export_text_lm``: fp16 ``save_pretrained`` + the target's tokenizer (what the served drafter checks its
   vocabulary against) + ``specula.json`` (kind, target_sha256: checked at serve start), then the manifest of
   ``out.parent``.

    cfg = TextLMTrainConfig(run_dir="runs/text_lm", target="target")
    export_text_lm(train(cfg), out=Path("zoo/weights/text_lm"))
    cfg = TextLMTrainConfig(run_dir="runs/my", target="/models/llava-1.5-7b-hf", data_file="data.jsonl")
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specula.training.drafters.distill_data import cut_at_image_token, same_data
from specula.training.drafters.common import (Cadence, check_data_fields, chunks_to_make, data_count, data_source,
                                              epoch_order, recipe_processor, save_checkpoint, warmup_cosine)
from specula.zoo import store as manifest
from specula.zoo.store import ZOO_DIR, sibling_ref
from specula.training.drafters.text_lm_config import TextLMArch, build_model, lm_macs_per_token

TEXT_LM_DIR = ZOO_DIR / "text_lm"
DATA_FORMAT = "specula-text-lm-data/1"
EVAL_SUITES = ("caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text")


@dataclass(frozen=True)
class TextLMTrainConfig:
    run_dir: str = "runs/text_lm"
    target: str = "target"  # zoo name or directory of the target (LLaVA-1.5, Qwen2.5-VL or the embedded one)
    tokenizer_dir: str = ""  # processor: tokenizer + image processor; "" = the target's own (its directory)
    arch: str = "embedded"  # TextLMArch name of a fresh LM
    init_lm: str = ""  # an existing causal LM directory to train instead of a fresh ``arch`` Llama; "" = fresh
    # data
    data_file: str = ""  # a conversation file (docs/training-data.md); "" = the embedded world's prompts
    image_root: str = ""  # where data_file's image paths resolve; "" = data_file's folder
    answers: str = "target"  # "target": its greedy answers + top-k log-probs; "data": data_file's own (hard targets)
    data_samples: int = 30_000  # with a data_file: at most the file's training prompts
    data_start: int = 1_000_000  # first train_stream index (the target trained on 0 .. ~60k); 0 in a data_file
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
        if not isinstance(self.init_lm, str):
            raise ValueError(f"TextLMTrainConfig.init_lm must be a directory path or '', got {self.init_lm!r}")
        check_data_fields(self)

    def data_key(self) -> dict:
        """The fields that define the cached data (with the target's weights): a rerun must not mix files."""
        keys = ("target", "data_start", "max_new_tokens", "topk", "chunk", "seed")
        return {k: getattr(self, k) for k in keys}


# ------------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Example:
    prompt: torch.Tensor  # [Lp] int64, text-only prompt (image tokens removed: ``text_view``)
    response: torch.Tensor  # [Lr] int64, the target's greedy answer (EOS included when reached), or the data's
    topk_ids: torch.Tensor  # [Lr, k] int64, the target's top-k tokens at each answer position (data: k 1, the token)
    topk_logp: torch.Tensor  # [Lr, k] fp32, their log-probabilities (temperature 1; data: 0)


def text_view(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """The prompt the served text_lm drafter reads: the target's prompt ids [L] (chat template applied, image tokens
    expanded) with every image token dropped -> [L'] (``drafters/text_lm.py`` ``begin`` does exactly this). The
    template's own image markup stays: Qwen2.5-VL's ``<|vision_start|><|vision_end|>`` pair per image, the newline
    LLaVA-1.5's template puts after each ``<image>``; rendering the template without the images would lose them, and
    the drafter would train on prompts it never sees."""
    return input_ids[input_ids != image_token_id]


def hard_example(prompt: torch.Tensor, response: torch.Tensor) -> Example:
    """An answer with no teacher distribution (the data's own): its top-k is the token itself, log-prob 0, so the
    soft term of the loss equals the hard one."""
    return Example(prompt, response, response[:, None].clone(), torch.zeros(len(response), 1))


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
    """World samples -> Examples of the target's answers (prompts through ``_encode``)."""
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
            result[i] = Example(text_view(encoded[i][0], image_id), resp, ti, tl)
    return result


def _source_examples(target, processor, source, split: str, indices: list[int], cfg: TextLMTrainConfig,
                     tag: str) -> list[Example]:
    """Prompts ``indices`` of a source's ``split`` -> Examples: the target's answers to each (with its images and,
    on Qwen2.5-VL, their ``image_grid_thw``), cut before an image token it writes; or, with ``answers="data"``, the
    source's own answers as hard targets."""
    got = [source.get(split, i) for i in indices]
    image_id = target.info.image_token_id
    if cfg.answers == "data":
        return [hard_example(text_view(g.prompt.input_ids, image_id), g.answer_ids[: cfg.max_new_tokens])
                for g in got]
    eos = set(target.info.eos_token_ids) | {processor.tokenizer.eos_token_id}
    order = sorted(range(len(got)), key=lambda j: len(got[j].prompt.input_ids))  # similar lengths batch together
    result: list[Example | None] = [None] * len(got)
    for g in range(0, len(order), cfg.gen_batch):
        group = order[g:g + cfg.gen_batch]
        reqs = [got[j].prompt.prefill(f"{tag}-{indices[j]}") for j in group]
        for j, (resp, ti, tl) in zip(group, answer_greedy(target, reqs, cfg.max_new_tokens, eos, cfg.topk)):
            n = len(cut_at_image_token(resp, image_id))
            result[j] = Example(text_view(got[j].prompt.input_ids, image_id), resp[:n], ti[:n], tl[:n])
    return result


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's weight files (``zoo.store.weights_fingerprint``): cached answers belong to exactly
    these weights, and the export's ``target_sha256`` is what serving checks the model against."""
    return manifest.weights_fingerprint(target_dir)


def data_key(cfg: TextLMTrainConfig, source, fingerprint: str) -> dict:
    """What defines the cached data: the config's ``data_key``, the target's weights and, for a conversation file,
    the file (its sha256 and held-out records) and where the answers come from."""
    key = {**cfg.data_key(), "target_sha256": fingerprint}
    if source is None:
        return key  # the world: as it always was
    return {**key, "data_start": 0, **source.key, "answers": cfg.answers}


def make_data(cfg: TextLMTrainConfig, target, processor, key: dict, log=print, source=None) -> Path:
    """Generate (or finish generating) ``<run_dir>/data`` for ``key`` (what defines the answers); returns the
    folder. ``source``: a conversation file's prompts (``training/data/sources.py``); None = the world's."""
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
    n, eval_n = train_counts(cfg, source, log)
    if not (data / "eval.safetensors").exists() and eval_n:
        if source is None:
            samples = [generate(EVAL_SUITES[i % len(EVAL_SUITES)], "eval", 20_000 + i, cfg.seed)
                       for i in range(eval_n)]
            held_out = _make_examples(target, processor, samples, cfg, "eval")
        else:
            held_out = _source_examples(target, processor, source, "eval", list(range(eval_n)), cfg, "eval")
        _write_examples(data / "eval.safetensors", list(range(eval_n)), held_out, key)
    todo, done = chunks_to_make(data, "train", n, cfg.chunk)
    if done:
        log(f"data: {done} of {n} target answers already in {data}")
    bar = tqdm(total=n, initial=done, unit="sample", desc="text_lm data", mininterval=5.0)
    for s in todo:
        m = min(cfg.chunk, n - s)
        if source is None:
            stream = train_stream(seed=cfg.seed, start=cfg.data_start + s)
            examples = _make_examples(target, processor, [next(stream) for _ in range(m)], cfg, f"t{s}")
        else:
            examples = _source_examples(target, processor, source, "train", list(range(s, s + m)), cfg, f"t{s}")
        _write_examples(data / f"train-{s:08d}.safetensors", list(range(s, s + m)), examples, key)
        bar.update(m)
    bar.close()
    return data


def train_counts(cfg: TextLMTrainConfig, source, log=print) -> tuple[int, int]:
    """(training, held-out) prompts the run uses: the config's, or all a conversation file holds when fewer."""
    if source is None:
        return cfg.data_samples, cfg.eval_samples
    return data_count(source, "train", cfg.data_samples, log), data_count(source, "eval", cfg.eval_samples, log)


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


def fit_vocab(e: Example, vocab) -> Example:
    """An example on the drafter LM's vocabulary (``drafters.vocab.VocabMap``): the served drafter drafts only ids
    below ``vocab.shared`` and feeds any other id as ``vocab.substitute``. So prompt ids past it are substituted,
    the answer is cut before its first one (no draft could ever match it) and top-k entries past it get no
    teacher mass. An LM over the target's own vocabulary (the world's, a fresh one) comes back unchanged."""
    if all(len(t) == 0 or int(t.max()) < vocab.shared for t in (e.prompt, e.response, e.topk_ids)):
        return e
    prompt = torch.where(e.prompt < vocab.shared, e.prompt, vocab.substitute)  # [Lp]
    out = (e.response >= vocab.shared).nonzero()
    n = int(out[0, 0]) if len(out) else len(e.response)
    ids, logp = e.topk_ids[:n], e.topk_logp[:n]  # [n, k]
    keep = ids < vocab.shared
    return Example(prompt, e.response[:n], torch.where(keep, ids, 0), torch.where(keep, logp, float("-inf")))


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


def answer_logp(model, batch: Batch, device, shared: int | None = None) -> torch.Tensor:
    """The LM's log-probs at every scored position [M, V'] fp32, over its first ``shared`` ids (the ones the served
    drafter drafts; None = all its rows)."""
    hidden = model.base_model(input_ids=batch.input_ids.to(device),
                              attention_mask=batch.attention_mask.to(device)).last_hidden_state  # [B, L, H]
    h = hidden[batch.rows.to(device), batch.cols.to(device)]  # [M, H]
    return model.get_output_embeddings()(h)[:, :shared].float().log_softmax(-1)  # [M, V']


def losses(model, batch: Batch, device, shared: int | None = None) -> dict[str, torch.Tensor]:
    """Hard CE on the target's greedy token, soft CE on its renormalized top-k, top-1 agreement."""
    logp = answer_logp(model, batch, device, shared)  # [M, V']
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
def evaluate(model, examples: list[Example], pad_id: int, device, budget: int = 8192,
             shared: int | None = None) -> dict[str, float]:
    was_training = model.training
    model.eval()
    n_tok, hard, agree_n, counted, blocks = 0, 0.0, 0, 0, 0
    for group in token_budget_batches(examples, budget):
        b = collate(group, pad_id)
        logp = answer_logp(model, b, device, shared)  # [M, V']
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


def drafter_lm(cfg: TextLMTrainConfig, tokenizer, width: int):
    """The LM to train and its ``VocabMap`` against the target (``drafters/vocab.py``, the served drafter's rule):
    a fresh ``cfg.arch`` Llama over the target's ``tokenizer`` with one logit per target id (``width``: the
    target's logits width), or the causal LM of ``cfg.init_lm`` (loaded as the served drafter loads one), whose own
    tokenizer must be the target's or a prefix of it. -> (model fp32 on cfg.device, vocab)."""
    from specula.drafters.text_lm import _load, _own_tokenizer
    from specula.drafters.vocab import check_vocab

    if cfg.init_lm:
        model, _ = _load(cfg.init_lm, torch.float32, "sdpa")
        own = _own_tokenizer(cfg.init_lm)
    else:
        model, own = build_model(TextLMArch.from_name(cfg.arch), tokenizer, seed=cfg.seed, vocab_size=width), tokenizer
    rows = model.get_output_embeddings().weight.shape[0]
    vocab = check_vocab("text_lm", rows, width, own, tokenizer, getattr(model.config, "pad_token_id", None))
    return model.to(cfg.device), vocab


def _weights(model) -> dict[str, torch.Tensor]:
    """The LM's tensors to checkpoint: a tied LM head is its embedding, saved once (safetensors refuses shared
    storage) and tied again on load."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def train(cfg: TextLMTrainConfig, log=print) -> Path:
    """Make the data (resumable), then train (resumable); returns the checkpoint folder."""
    from specula.targets import load_target
    from specula.zoo.store import resolve

    torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    ckpt = run / "ckpt"
    run.mkdir(parents=True, exist_ok=True)
    target_dir = resolve(cfg.target)
    processor = recipe_processor(cfg, target_dir)
    tok = processor.tokenizer
    source = data_source(cfg, processor, log=log) if cfg.data_file else None  # every record checked here
    target = load_target(target_dir, device=cfg.device)
    key = data_key(cfg, source, target_fingerprint(target_dir))
    data_dir = make_data(cfg, target, processor, key, log, source)
    target_macs, image_id, width = (lm_macs_per_token(target.model.config.text_config),
                                    target.info.image_token_id, target.info.vocab_size)
    del target
    n, eval_n = train_counts(cfg, source, lambda _m: None)
    model, vocab = drafter_lm(cfg, tok, width)
    data = [fit_vocab(e, vocab) for e in load_data(data_dir, n)]
    held_out = [fit_vocab(e, vocab) for e in read_examples(data_dir / "eval.safetensors")] if eval_n else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else vocab.substitute

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    state = {"samples": 0, "steps": 0, "elapsed_s": 0.0, "history": [], "config": asdict(cfg),
             "compute_ratio": round(lm_macs_per_token(model.config) / target_macs, 4), "image_token_id": image_id,
             "target_sha256": key["target_sha256"], "data_samples": len(data)}
    if (ckpt / "state.json").exists():
        old = json.loads((ckpt / "state.json").read_text())
        for name in ("arch", "init_lm"):
            if old["config"].get(name, "") != getattr(cfg, name):
                raise ValueError(f"{ckpt} holds a model of {name} {old['config'].get(name, '')!r}; this run asks for "
                                 f"{getattr(cfg, name)!r}: use another run_dir")
        model.load_state_dict(load_file(ckpt / "model.safetensors", device=str(cfg.device)), strict=False)
        model.tie_weights()
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=cfg.device))
        state.update({k: old[k] for k in ("samples", "steps", "elapsed_s", "history")})
        log(f"resumed from {ckpt}: {state['samples']} samples, {state['elapsed_s'] / 60:.1f} min")
    what = cfg.init_lm or cfg.arch
    log(f"text_lm {what}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
        f"{state['compute_ratio']:.3f} of the target LM's matmul compute per token, {len(data)} examples")

    def save() -> None:
        save_checkpoint(ckpt, "model.safetensors", _weights(model), opt, state,
                        {"config.json": model.config.to_json_string()})

    def run_eval() -> None:
        if held_out:
            res = evaluate(model, held_out, pad, cfg.device, cfg.token_budget, vocab.shared)
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
            batch = collate(group, pad)
            if len(batch.rows):  # a batch of answers cut to nothing (an image token first) teaches nothing
                lr = lr_at(state["samples"], cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                parts = losses(model, batch, cfg.device, vocab.shared)
                loss = (1 - cfg.kd_weight) * parts["hard"] + cfg.kd_weight * parts["soft"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                for k, v in parts.items():
                    x = float(v.detach())
                    ema[k] = 0.98 * ema.get(k, x) + 0.02 * x
            state["steps"] += 1
            state["samples"] += len(group)
            bar.update(len(group))
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        clock.tick(run_eval, save)
    bar.close()
    run_eval()
    save()
    return ckpt


# ------------------------------------------------------------------------------------------------------- export


def _trained_model(ckpt: Path, state: dict, tokenizer):
    """The checkpoint's LM in fp32: rebuilt from its config.json (a fresh Llama or an ``init_lm`` of any causal LM
    type), or, for a checkpoint written before it kept one, from its arch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (ckpt / "config.json").exists():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt, local_files_only=True)).float()
    else:
        model = build_model(TextLMArch.from_name(state["config"]["arch"]), tokenizer)
    model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    model.tie_weights()
    return model


def export_text_lm(ckpt: Path, out: Path = TEXT_LM_DIR, tokenizer_dir: Path | str | None = None) -> Path:
    """Checkpoint -> a ``from_pretrained`` causal LM directory (fp16 storage, fp32 compute) + the target's tokenizer
    + specula.json; then rewrites the zoo's manifest when ``out`` is in the zoo (the default). ``tokenizer_dir``: whose
    tokenizer to save beside it (default: the one training used, the target's own unless the run named another)."""
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    ckpt, out = Path(ckpt), Path(out)
    state = json.loads((ckpt / "state.json").read_text())
    conf = state["config"]
    tok = load_processor(tokenizer_dir or conf.get("tokenizer_dir") or resolve(conf["target"])).tokenizer
    model = _trained_model(ckpt, state, tok)
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.float16).save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"  # stored in fp16, computed in fp32
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    info = {
        "kind": "text_lm", "arch": None if conf.get("init_lm") else conf["arch"],
        "init_lm": conf.get("init_lm") or None, "params": sum(p.numel() for p in model.parameters()),
        "compute_ratio": state["compute_ratio"], "image_token_id": state["image_token_id"],
        "distilled_from": sibling_ref(conf["target"], out), "target_sha256": state["target_sha256"],
        "data_file": conf.get("data_file") or None, "answers": conf.get("answers", "target"),
        "data_samples": state.get("data_samples", conf["data_samples"]),  # prompts trained on
        "trained_samples": state["samples"], "train_minutes": round(state["elapsed_s"] / 60, 1),
        "device": conf.get("device", "cpu"),  # what train_minutes were measured on
        "history": state["history"], "storage_dtype": "float16",
    }
    (out / "specula.json").write_text(json.dumps(info, indent=1) + "\n")
    if out.resolve().parent == ZOO_DIR.resolve():  # a user's --out is theirs: no manifest.json beside it
        manifest.write(out.parent)
    return out


def train_text_lm_cli(args) -> int:
    """``specula train text_lm``: args run_dir, target, arch, init_lm, data, image_root, answers, data_samples,
    samples, max_new_tokens, seed, threads, device, ckpt_every, eval_every, export (bool), out (None =
    zoo/weights/text_lm)."""
    from specula.training.drafters.eagle import data_cli_config

    cfg = TextLMTrainConfig(run_dir=args.run_dir, target=args.target, arch=args.arch,
                            init_lm=getattr(args, "init_lm", None) or "", data_samples=args.data_samples,
                            total_samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            threads=args.threads, device=args.device, ckpt_every_s=args.ckpt_every,
                            eval_every_s=args.eval_every, **data_cli_config(args))
    ckpt = train(cfg)
    if args.export:
        print(f"exported to {export_text_lm(ckpt, Path(args.out) if args.out else TEXT_LM_DIR)}")
    return 0
