"""Shared fixtures of the runtime's serving tests: a tiny random-weight LLaVA (the embedded architecture at "tiny"
size, the world's real tokenizer, drafter_kit's lively weights, so greedy answers vary from prompt to prompt and
position to position) saved to a temp dir as a real checkpoint, and its processor. Helpers are in
serve_kit.py. Everything runs on one torch thread: the machines are shared and these models are small.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    import sys
    from pathlib import Path

    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
    from drafter_kit import lively_target

    out = tmp_path_factory.mktemp("tiny_llava")
    processor = load_processor(TOKENIZER_DIR)
    lively_target(processor).save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def processor(model_dir):
    from specula.targets.processor import load_processor

    return load_processor(model_dir)


@pytest.fixture(scope="session")
def repetitive_model_dir(tmp_path_factory, processor):
    """The same tiny LLaVA at its init weights: every greedy answer repeats one token. Only for tests of mechanisms
    that need blocks accepted whole (drafting ahead, offers used); equality with plain decoding is checked on
    ``model_dir`` too, whose answers vary."""
    from specula.targets.embedded_arch import TargetArch, build_model

    out = tmp_path_factory.mktemp("tiny_llava_repetitive")
    build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out
