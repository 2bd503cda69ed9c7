"""``specula zoo probe``: where grounding fails — the vision path, or the LM's own lookup.

Three accuracies on the same held-out questions, per question type:

- ``real``    the target as it is (visual tokens from its tower + projector);
- ``oracle``  the visual tokens of patches that show an object replaced by the patch's words' embeddings (colour,
              shape, size, place; summed, rescaled to the real token's RMS): what a perfect projector into the
              LM's word space would hand the LM. If ``oracle`` is no better than ``real``, the LM cannot read
              the tokens however good they are, and the vision path is not what to train;
- ``described`` the scene described in words (the world's text/scene questions): the LM's copy-from-context
              skill with no vision at all.
"""

from __future__ import annotations

import json

import torch

from specula.runtime.prompts import encode_prompt
from specula.world.sample import Sample
from specula.world.suites import generate
from specula.zoo.evaluate import EVAL_OFFSET
from specula.zoo.quality import greedy_answer, normalize


def oracle_visual(model, word_ids: list[list[int]], real: torch.Tensor) -> torch.Tensor:
    """real [T, H] projected visual tokens of one image; word_ids[t] the patch's word token ids (empty: keep) ->
    [T, H] with each object patch replaced by the sum of its words' embeddings at the real token's RMS."""
    emb = model.get_input_embeddings().weight  # [V, H]
    out = real.clone()
    for t, ids in enumerate(word_ids):
        if ids:
            v = emb[ids].sum(0)  # [H]
            out[t] = v / v.pow(2).mean().sqrt() * real[t].pow(2).mean().sqrt()
    return out


@torch.inference_mode()
def answer_with_visual(model, processor, s: Sample, visual: torch.Tensor, max_new_tokens: int = 8) -> str:
    """Greedy answer to a one-image sample with the given visual tokens [T, H] in place of the image tokens."""
    ids, _ = encode_prompt(processor, s.prompt, s.images)
    embeds = model.get_input_embeddings()(ids[None])  # [1, L, H]
    embeds[ids[None] == model.config.image_token_id] = visual.to(embeds.dtype)
    lm, out = model.model.language_model, []
    for _ in range(max_new_tokens):  # short answers: recomputing the prefix is cheaper than managing a cache here
        t = int(model.lm_head(lm(inputs_embeds=embeds).last_hidden_state[:, -1]).argmax(-1))
        if t == processor.tokenizer.eos_token_id:
            break
        out.append(t)
        embeds = torch.cat([embeds, model.get_input_embeddings()(torch.tensor([[t]]))], 1)
    return processor.tokenizer.decode(out, skip_special_tokens=True)


def probe(model, processor, n: int = 100, seed: int = 0) -> dict:
    from specula.zoo.batching import Encoder

    enc = Encoder(processor)
    rows: dict[str, dict] = {}

    def hit(pred: str, s: Sample) -> bool:
        return normalize(pred.split(".")[0]) == normalize(s.answer or "")

    for i in range(n):
        s = generate("vqa", "eval", EVAL_OFFSET + i, seed)
        _, pix = encode_prompt(processor, s.prompt, s.images)
        real = model.model.get_image_features(pixel_values=pix, return_dict=True).pooler_output[0]  # [T, H]
        words = [[w for w in map(enc.word_id, ws) if w >= 0] for ws in s.patch_words[0]]
        r = rows.setdefault(s.kind.split("/", 1)[-1], {"n": 0, "real": 0.0, "oracle": 0.0})
        r["n"] += 1
        r["real"] += hit(answer_with_visual(model, processor, s, real), s)
        r["oracle"] += hit(answer_with_visual(model, processor, s, oracle_visual(model, words, real)), s)
    described = [s for s in (generate("text", "eval", EVAL_OFFSET + i, seed) for i in range(4 * n))
                 if s.kind == "text/scene"][:n]
    out = {"n": n, "by_type": {}, "real": 0.0, "oracle": 0.0}
    for k, r in sorted(rows.items()):
        out["real"] += r["real"] / n
        out["oracle"] += r["oracle"] / n
        out["by_type"][k] = {"n": r["n"], "real": r["real"] / r["n"], "oracle": r["oracle"] / r["n"]}
    out["described"] = sum(hit(greedy_answer(model, processor, s, 8), s) for s in described) / max(1, len(described))
    out["described_n"] = len(described)
    return out


def probe_cli(args) -> int:
    from specula.zoo.evaluate import load_model

    model, processor = load_model(args.model)
    r = probe(model, processor, n=args.n)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"vqa (n={r['n']}): real {r['real']:.3f}  oracle visual tokens {r['oracle']:.3f}")
    for k, t in r["by_type"].items():
        print(f"  {k:14s} n={t['n']:<4d} real={t['real']:.3f}  oracle={t['oracle']:.3f}")
    print(f"described scene (n={r['described_n']}): {r['described']:.3f}")
    return 0
