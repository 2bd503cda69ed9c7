"""Images moved in front of a user message's text for LLaVA targets (runtime/serve/image_order.py): the request a
text-first OpenAI message makes is the image-first one, token for token; interleaved images keep their places."""

from __future__ import annotations

import pytest

from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.image_order import image_parts_first

from serve_kit import make_config

IMG = {"type": "image"}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.mark.parametrize("content, want", [
    ([_text("What colour is the star?"), IMG], [IMG, _text("What colour is the star?")]),
    ([_text("Look."), IMG, _text("What colour?")], [IMG, _text("Look. "), _text("What colour?")]),
    ([_text("Look. "), IMG, _text("What colour?")], [IMG, _text("Look. "), _text("What colour?")]),
    ([_text("Two:"), IMG, IMG, _text(" Same?")], [IMG, IMG, _text("Two:"), _text(" Same?")]),
    ([IMG, _text("Already first.")], [IMG, _text("Already first.")]),
    ([_text("Image 1: "), IMG, _text(" Image 2: "), IMG, _text(" Same?")],  # interleaved: kept
     [_text("Image 1: "), IMG, _text(" Image 2: "), IMG, _text(" Same?")]),
    ([_text("No image.")], [_text("No image.")]),
])
def test_a_single_run_of_images_goes_first(content, want):
    msgs = [{"role": "system", "content": [_text("Be brief.")]}, {"role": "user", "content": content},
            {"role": "assistant", "content": [_text("ok"), _text("!")]}, {"role": "user", "content": "plain"}]
    out = image_parts_first(msgs)
    assert out[1]["content"] == want
    assert out[0] == msgs[0] and out[2] == msgs[2] and out[3] == msgs[3]
    assert msgs[1]["content"] == content  # the caller's messages are left as they were


def test_ingress_reads_a_text_first_message_as_the_image_first_one(model_dir, tmp_path):
    from specula.runtime.engine.factory import reads_images_first
    from specula.runtime.serve.ingress import IngressEngine
    from specula.world import generate

    cfg = make_config(model_dir)
    assert cfg.model.image_parts_first is None and reads_images_first(cfg)  # a LLaVA: on unless said otherwise
    assert not reads_images_first(make_config(model_dir, model={"path": str(model_dir), "image_parts_first": False}))
    on = IngressEngine.from_config(cfg)
    off = IngressEngine(on.processor, on.limits)
    s = generate("vqa", "eval", 0)
    params = SamplingParams(max_tokens=4)

    def ids(engine, content):
        req = engine.prepare_chat([{"role": "user", "content": content}], list(s.images), params, "r")
        return req.input_ids.tolist()

    question = _text(s.prompt.replace("<image>", ""))
    first = ids(on, [IMG, question])
    assert ids(on, [question, IMG]) == first and ids(off, [IMG, question]) == first
    assert ids(off, [question, IMG]) != first  # what the target reads at 0.02 (zoo/TRAINING.md)

    from transformers import Qwen2_5_VLConfig

    qwen = tmp_path / "qwen"
    Qwen2_5_VLConfig().save_pretrained(qwen)
    assert not reads_images_first(make_config(qwen))  # trained on interleaved prompts: left as sent
