"""Shared fixtures of the runtime's serving tests: a tiny random-weight LLaVA (the embedded architecture at "tiny"
size, the world's real tokenizer) saved to a temp dir as a real checkpoint, and its processor. Helpers are in
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
    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    out = tmp_path_factory.mktemp("tiny_llava")
    processor = load_processor(TOKENIZER_DIR)
    build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def processor(model_dir):
    from specula.targets.processor import load_processor

    return load_processor(model_dir)
