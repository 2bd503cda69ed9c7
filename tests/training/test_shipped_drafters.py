"""Every shipped drafter: trained against the shipped target's exact weights, loads from the zoo through the
registry, and speculative decoding with it emits exactly what plain decoding emits (greedy, two world prompts).

A drafter distilled from an older target still decodes losslessly, but its figures would describe another model:
the sha256 check makes a target retrain without its drafters' retrain fail here."""

import json

import pytest

from specula.training.drafters.distill_data import target_fingerprint
from specula.zoo.store import TARGET_DIR, ZOO_DIR

NOT_DRAFTERS = {"target", "tokenizer"}
SHIPPED = sorted(d.name for d in ZOO_DIR.iterdir() if d.is_dir() and d.name not in NOT_DRAFTERS
                 and (d / "specula.json").exists()) if ZOO_DIR.is_dir() else []

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").exists(), reason="no shipped target in this checkout")


@pytest.fixture(scope="module")
def shipped_target():
    import torch

    from specula.targets import load_target
    from specula.targets.processor import load_processor

    torch.set_num_threads(1)
    return load_target(TARGET_DIR), load_processor(TARGET_DIR)


def test_some_drafter_is_shipped():
    assert "text_lm" in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafter_belongs_to_the_shipped_target_and_is_lossless(name, shipped_target):
    from specula.runtime.bench.spec import bench_prompts, make_drafter
    from specula.runtime.engine.loop import GenerationRequest, SpecEngine
    from specula.runtime.core.sampling import SamplingParams
    from specula.targets import load_target

    info = json.loads((ZOO_DIR / name / "specula.json").read_text())
    assert info.get("target_sha256") == target_fingerprint(TARGET_DIR), f"{name} was trained on another target"
    target, processor = shipped_target
    drafter = make_drafter({"kind": info.get("kind", name), "path": name}, target, processor.tokenizer)
    params = SamplingParams(max_tokens=16)
    reqs = [GenerationRequest(pid, ids, pix, params)
            for _, pid, ids, pix in bench_prompts(processor, ("caption", "vqa"), 1, 0)]
    eos = [processor.tokenizer.eos_token_id]
    want = SpecEngine(load_target(TARGET_DIR), None, eos_token_ids=eos).generate(reqs)
    got = SpecEngine(target, drafter, gamma=4, eos_token_ids=eos).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in want.items()}
    assert sum(v.metrics.accepted_tokens for v in got.values()) > 0, f"{name}: no draft was ever accepted"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_records_name_zoo_entries_a_fresh_clone_has(name):
    """What a drafter's record names (its target, the LM it started from) must resolve in the shipped zoo: a drafter
    replica without the target in its process reads the target's embedding and lm_head from ``target``."""
    from specula.zoo.store import resolve

    info = json.loads((ZOO_DIR / name / "specula.json").read_text())
    for key in ("target", "distilled_from", "init_lm"):
        ref = info.get(key)
        if ref:
            assert not str(ref).startswith(("runs/", "/")), f"{name}: {key} = {ref!r} is not a zoo entry"
            assert resolve(ref).is_relative_to(ZOO_DIR), f"{name}: {key} = {ref!r}"
