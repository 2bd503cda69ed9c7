"""Session fixtures shared by every test folder: tiny checkpoints in the stock hub layouts (tests/stock_checkpoints.py).

    def test_mine(llava15_dir, qwen25vl_dir):   # pathlib.Path directories, built once per run (about a second each)
        target = load_target(llava15_dir); processor = load_processor(llava15_dir)

Treat the directories as read-only: they are shared by the whole session. ``import stock_checkpoints`` works from any
test module (this file's folder is on ``sys.path``) for the builders and the templates themselves.
"""

from __future__ import annotations

import pytest

from stock_checkpoints import build_llava15, build_qwen25vl


@pytest.fixture(scope="session")
def llava15_dir(tmp_path_factory):
    """A tiny llava-hf/llava-1.5-7b-hf-layout checkpoint directory (336 px, 576 image tokens, Llama tokenizer)."""
    return build_llava15(tmp_path_factory.mktemp("llava15"))


@pytest.fixture(scope="session")
def qwen25vl_dir(tmp_path_factory):
    """A tiny Qwen/Qwen2.5-VL-7B-Instruct-layout checkpoint directory (window ViT, mrope, image_grid_thw)."""
    return build_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


@pytest.fixture(scope="session")
def conversations_file(tmp_path_factory):
    """A user's conversation file with PNGs beside it (tests/user_data.py): one-image, two-image and text-only
    records; image paths relative to the file's folder."""
    from user_data import build_conversations

    return build_conversations(tmp_path_factory.mktemp("user_data"))
