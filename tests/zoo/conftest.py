"""Fixtures shared by the zoo tests."""

import pytest

from specula.targets.processor import load_processor
from specula.zoo.paths import TOKENIZER_DIR


@pytest.fixture(scope="module")
def processor():
    """The shipped processor (tokenizer + image processor), loaded once per test module."""
    return load_processor(TOKENIZER_DIR)
