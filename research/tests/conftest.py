"""Fixtures shared by the research tests."""

import pytest

from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def processor():
    """The shipped processor (tokenizer + image processor), loaded once per test module."""
    return load_processor(TOKENIZER_DIR)
