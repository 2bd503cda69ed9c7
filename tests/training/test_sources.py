"""training/data/sources.py: a conversation file's prompts and answers as the target's own template renders them."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.engine.prompts import encode_messages
from specula.targets.processor import load_processor
from specula.training.data.sources import ConversationSource, answer_tokens


@pytest.mark.parametrize("layout", ["llava15_dir", "qwen25vl_dir"])
def test_an_answer_ends_where_the_target_stops(layout, request):
    """The data's answer as tokens ends with the EOS the target emits to stop: after the text on LLaVA-1.5 (whose
    template writes nothing after an answer), Qwen2.5-VL's <|im_end|> once (its template's turn end)."""
    processor = load_processor(request.getfixturevalue(layout))
    tok = processor.tokenizer
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What colour is the star?"}]}]
    ids = answer_tokens(processor, msgs, "Yellow.").tolist()
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids[:-1]).strip() == "Yellow."


@pytest.mark.parametrize("layout", ["llava15_dir", "qwen25vl_dir"])
def test_the_file_gives_every_split_in_the_targets_template(layout, request, conversations_file):
    processor = load_processor(request.getfixturevalue(layout))
    src = ConversationSource(conversations_file, None, processor, progress=False)
    sizes = {s: src.size(s) for s in ("train", "text", "vision", "eval")}
    assert sizes["train"] == sizes["text"] + sizes["vision"] and min(sizes.values()) > 0
    p = src.get("vision", 0)
    image = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<image>"))
    assert p.prompt.pixel_values is not None and bool((p.prompt.input_ids == image).any())
    t = src.get("text", 0)
    assert t.prompt.pixel_values is None and not bool((t.prompt.input_ids == image).any())
    again = encode_messages(processor, src.splits["text"][0][1].messages, [])
    assert torch.equal(again.input_ids, t.prompt.input_ids)  # what any front door renders for the same messages
    with pytest.raises(IndexError, match="text prompts"):
        src.get("text", sizes["text"])
