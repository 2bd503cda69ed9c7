"""Host overhead of our decoding path against Hugging Face on the same model, ratios measured in one run.

    python -m specula.runtime.bench.overhead                    # embedded-size random LLaVA, 1 torch thread
    python -m specula.runtime.bench.overhead --arch tiny --rounds 5 --steps 32

Builds a random LLaVA of the zoo architecture (``TargetArch``) with the zoo tokenizer, saves it to a temporary
directory and loads it twice: as our target (``load_target``) and as its stock HF class
(``LlavaForConditionalGeneration``, the class ``load_target`` picked).
One image prompt, batch 1, greedy, EOS disabled on both sides so every run emits exactly ``--new-tokens``.

Measured round robin (so drift on a shared machine hits every number alike), medians:

  end to end (prefill + ``--new-tokens`` tokens, per run):
    hf_generate   ``model.generate(max_new_tokens=N, do_sample=False)``
    engine_plain  ``SpecEngine(target, None).generate`` (our plain decoding: the number speedups divide by)
  per step (cache length grows by one token per step, both sides alike):
    hf_step1      bare stock forward of 1 token with a stock DynamicCache (what ``generate`` runs per token;
                  our target's cache appends in place, HF's concatenates: that difference is part of what is
                  measured)
    decode        ``target.decode_step`` + ``commit`` (what the plain engine runs per token, sampling excluded)
    hf_step{g+1}  bare stock forward of gamma + 1 tokens (causal, no custom mask), then cache cropped back
    verify{g}     ``target.verify`` of a gamma-token chain + ``commit`` accepting nothing

Ratios printed: engine_plain / hf_generate, decode / hf_step1, verify{g} / hf_step{g+1}, verify{g} / decode.
Greedy outputs of the two end-to-end paths are checked equal token for token. Timings on a shared machine are
noisy: compare ratios from one run, and repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(arch_name: str, out: Path) -> Path:
    """A random LLaVA of the zoo architecture + the zoo tokenizer/processor, saved as a HF checkpoint dir."""
    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    arch = TargetArch.from_name(arch_name)
    processor = load_processor(TOKENIZER_DIR)
    model = build_model(arch, processor.tokenizer)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _prompt(processor):
    from PIL import Image

    import specula.world
    from specula.runtime.engine.prompts import encode_prompt

    sample = Path(specula.world.__file__).parent / "assets" / "sample.png"
    return encode_prompt(processor, "<image>What colour is the star? Answer with one word.",
                         [Image.open(sample).convert("RGB")])  # the checkpoint's chat template


def run(arch: str = "embedded", new_tokens: int = 64, gamma: int = 5, rounds: int = 7, steps: int = 24,
        warmup: int = 1, log=print) -> dict:
    from transformers import DynamicCache

    from specula.runtime.engine.loop import GenerationRequest, SpecEngine
    from specula.runtime.core.sampling import SamplingParams
    from specula.targets import Accept, DraftBlock, PrefillRequest, load_target
    from specula.targets.processor import load_processor

    tmp = tempfile.TemporaryDirectory(prefix="specula-overhead-")
    path = build_checkpoint(arch, Path(tmp.name))
    processor = load_processor(path)
    ids, pix = _prompt(processor)
    target = load_target(str(path))
    hf = type(target).hf_class.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None  # emit exactly new_tokens on both sides
    n_params = sum(p.numel() for p in hf.parameters())
    engine = SpecEngine(target, None, eos_token_ids=())
    params = SamplingParams(max_tokens=new_tokens)
    counter = iter(range(1 << 30))

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(input_ids=ids[None], pixel_values=pix, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=processor.tokenizer.pad_token_id)
        return out[0, ids.shape[0]:].tolist()

    def engine_plain():
        res = engine.generate([GenerationRequest(f"e2e-{next(counter)}", ids, pix, params)])
        return next(iter(res.values())).tokens

    # ---- end to end ------------------------------------------------------------------------------------------
    e2e: dict[str, list[float]] = {"hf_generate": [], "engine_plain": []}
    fns = {"hf_generate": hf_generate, "engine_plain": engine_plain}
    outputs = {}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            outputs[name] = fn()
            dt = time.perf_counter() - t
            if r >= warmup:
                e2e[name].append(dt)
    exact = outputs["hf_generate"] == outputs["engine_plain"]

    # ---- per step --------------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(0)
    vocab = target.info.vocab_size
    step: dict[str, list[float]] = {"hf_step1": [], "decode": [], f"hf_step{gamma + 1}": [], f"verify{gamma}": []}
    with torch.no_grad():
        for r in range(warmup + rounds):
            # fresh prompt state on both sides (untimed)
            rid = f"step-{next(counter)}"
            out = target.prefill([PrefillRequest(rid, ids, pix)])
            target.commit([Accept(rid, (), int(out.logits[0].argmax()))])
            cache = DynamicCache(config=hf.config.text_config)
            o = hf(input_ids=ids[None], pixel_values=pix, past_key_values=cache, use_cache=True)
            nxt = o.logits[:, -1:].argmax(-1)  # [1, 1]
            for _ in range(steps):
                keep = r >= warmup
                t = time.perf_counter()
                o = hf(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
                dt = time.perf_counter() - t
                if keep:
                    step["hf_step1"].append(dt)

                t = time.perf_counter()
                v = target.decode_step([rid])
                target.commit([Accept(rid, (), int(v.logits[0, 0].argmax()))])
                dt = time.perf_counter() - t
                if keep:
                    step["decode"].append(dt)

                block = torch.randint(3, vocab, (1, gamma + 1), generator=g)
                t = time.perf_counter()
                o = hf(input_ids=block, past_key_values=cache, use_cache=True)
                o.logits.argmax(-1)
                dt = time.perf_counter() - t
                cache.crop(-(gamma + 1))  # transformers 5: a negative count removes tokens
                if keep:
                    step[f"hf_step{gamma + 1}"].append(dt)

                t = time.perf_counter()
                v = target.verify(DraftBlock.chain([rid], block[:, :gamma]))
                target.commit([Accept(rid, (), int(v.logits[0, 0].argmax()))])
                dt = time.perf_counter() - t
                if keep:
                    step[f"verify{gamma}"].append(dt)
                # verify grew our cache by one: grow the HF one too so lengths stay equal
                o = hf(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
            target.release([rid])

    med = {k: statistics.median(v) * 1e3 for k, v in {**e2e, **step}.items()}  # ms
    ratios = {
        "engine_plain / hf_generate": med["engine_plain"] / med["hf_generate"],
        "decode / hf_step1": med["decode"] / med["hf_step1"],
        f"verify{gamma} / hf_step{gamma + 1}": med[f"verify{gamma}"] / med[f"hf_step{gamma + 1}"],
        f"verify{gamma} / decode": med[f"verify{gamma}"] / med["decode"],
    }
    tmp.cleanup()
    return {
        "arch": arch, "params": n_params, "prompt_tokens": int(ids.shape[0]), "new_tokens": new_tokens,
        "gamma": gamma, "rounds": rounds, "steps_per_round": steps, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "greedy_exact": exact, "median_ms": med, "ratios": ratios,
    }


def render(r: dict) -> str:
    lines = [f"arch {r['arch']} ({r['params'] / 1e6:.1f}M params), prompt {r['prompt_tokens']} tokens, "
             f"{r['new_tokens']} new tokens, gamma {r['gamma']}, {r['rounds']} rounds x {r['steps_per_round']} "
             f"steps, {r['torch_threads']} torch thread(s), greedy outputs equal: {r['greedy_exact']}", "",
             "| measurement | median ms |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in r["median_ms"].items()]
    lines += ["", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in r["ratios"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="embedded", help="zoo TargetArch name (embedded, tiny)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=24, help="timed steps per round in the per-step section")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = run(args.arch, args.new_tokens, args.gamma, args.rounds, args.steps)
    print(render(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
