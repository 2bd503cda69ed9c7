"""The world's tokenizer: loads with AutoTokenizer, has a chat template and an image token, keeps words whole."""

import json

from transformers import AutoTokenizer

from specula.world.tokenizer import CHAT_TEMPLATE, format_turns, train_tokenizer
from specula.world.vocab import COLOUR_NAMES, SHAPES
from specula.zoo.store import TOKENIZER_DIR


def test_shipped_tokenizer_loads_with_chat_template():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the star?"}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == format_turns("<image>What colour is the star?")
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "blue"}], tokenize=False)
    assert full == format_turns("<image>What colour is the star?", "blue")


def test_image_token_and_answer_words_are_single_tokens():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert len(tok("<image>", add_special_tokens=False).input_ids) == 1
    for w in COLOUR_NAMES + SHAPES + ("yes", "no", "left", "right"):
        ids = tok(w, add_special_tokens=False).input_ids
        assert len(ids) == 1, (w, tok.convert_ids_to_tokens(ids))
        # the same token at the start of an answer and inside a sentence
        assert ids[0] in tok(f"a {w} thing", add_special_tokens=False).input_ids


def test_decode_roundtrip():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = "Yes. There are two red objects and one blue object, so the red ones are more numerous."
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_training_is_deterministic(tmp_path):
    train_tokenizer(tmp_path / "a", vocab_size=300, n_samples=300)
    train_tokenizer(tmp_path / "b", vocab_size=300, n_samples=300)
    a = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    b = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    assert a["model"]["vocab"] == b["model"]["vocab"] and a["model"]["merges"] == b["model"]["merges"]
