"""Prompts with the image off the start: the placed mix's forms, the held-out evaluation forms, and their encoding
as the OpenAI API's chat template writes the same messages."""

import random
from collections import Counter

import pytest
from transformers import AutoTokenizer

from specula.world import generate, placed
from specula.world.sample import IMAGE_MARK
from specula.world.tokenizer import SYSTEM, format_turns
from specula.zoo.store import TOKENIZER_DIR


def _form(s, original) -> str:
    if s.system:
        return "system"
    if s.prompt == original.prompt:
        return "first"
    if s.prompt.endswith(IMAGE_MARK) and s.prompt.count(IMAGE_MARK) == 1:
        return "question_first"
    assert s.prompt.endswith(original.prompt)
    return "lead"


def test_variants_keep_the_question_and_answer():
    s = generate("vqa", "eval", 3)
    lead = placed.variant(s, "lead")
    assert lead.prompt == placed.EVAL_LEAD + s.prompt and lead.answer == s.answer and lead.images == s.images
    moved = placed.variant(s, "question_first")
    assert moved.prompt == s.prompt[len(IMAGE_MARK):] + " " + IMAGE_MARK and moved.answer == s.answer
    system = placed.variant(s, "system")
    assert system.system == placed.EVAL_SYSTEM and system.prompt == s.prompt
    with pytest.raises(ValueError, match="unknown prompt form"):
        placed.variant(s, "sideways")
    with pytest.raises(ValueError, match="does not open with its only image"):
        placed.variant(generate("multi_image", "eval", 0), "question_first")


def test_placed_mix_moves_half_the_prompts_and_holds_the_evaluation_forms_out():
    from specula.world.suites import MIXES

    mix = MIXES["scan_placed"]
    assert [(n, t, w) for n, _, t, w in mix] == [(n, t, w) for n, _, t, w in MIXES["scan_suites"]]
    base = {n: m for n, m, _, _ in MIXES["scan_suites"]}
    forms, leads = Counter(), set()
    for i in range(600):
        name, maker, task, _ = mix[i % len(mix)]
        s = maker(random.Random(f"placed/{i}"), name, task)
        again = maker(random.Random(f"placed/{i}"), name, task)
        assert (s.prompt, s.system, s.response) == (again.prompt, again.system, again.response)  # deterministic
        original = base[name](random.Random(f"placed/{i}"), name, task)
        assert s.response == original.response and s.images == original.images  # only the prompt's form changes
        if len(s.images) != 1:
            assert s.prompt == original.prompt  # image sets and text-only samples get a system turn at most
        form = _form(s, original)
        forms[form] += 1
        if form == "lead":
            leads.add(s.prompt[: -len(original.prompt)])
        assert placed.EVAL_LEAD not in s.prompt and s.system != placed.EVAL_SYSTEM
    assert 0.4 < forms["first"] / 600 < 0.6
    assert min(forms["lead"], forms["question_first"], forms["system"]) > 25
    assert len(leads) > 30  # many lead lines, not a few memorised ones


def test_system_turn_is_encoded_as_the_chat_template_writes_it():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    msgs = [{"role": "system", "content": "Be brief and precise."},
            {"role": "user", "content": [{"type": "text", "text": "Hi! What colour is the star? "}, {"type": "image"}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == format_turns("Hi! What colour is the star? <image>", system="Be brief and precise.")
    assert SYSTEM in text and format_turns("<image>x") == format_turns("<image>x", system="")


def test_training_encoder_labels_only_the_answer_after_a_system_turn():
    from specula.targets.processor import load_processor
    from specula.training.target.batching import Encoder

    processor = load_processor(TOKENIZER_DIR)
    s = placed.variant(generate("vqa", "train", 5), "system")
    enc = Encoder(processor).encode(s)
    tok = processor.tokenizer
    ids = enc.input_ids.tolist()
    assert ids.count(tok.convert_tokens_to_ids(SYSTEM)) == 1
    labelled = tok.decode([t for t, lab in zip(ids, enc.labels.tolist()) if lab != -100], skip_special_tokens=True)
    assert labelled.strip() == s.response.strip()


def test_placed_multi_mix_is_the_image_sets_mix_placed():
    from specula.world.suites import MIXES

    mix, base = MIXES["scan_placed_multi"], {n: m for n, m, _, _ in MIXES["scan_multi"]}
    assert [(n, t, w) for n, _, t, w in mix] == [(n, t, w) for n, _, t, w in MIXES["scan_multi"]]
    moved = 0
    for i in range(120):
        name, maker, task, _ = mix[i % len(mix)]
        s, original = maker(random.Random(f"pm/{i}"), name, task), base[name](random.Random(f"pm/{i}"), name, task)
        assert s.response == original.response and s.images == original.images
        moved += (s.prompt, s.system) != (original.prompt, original.system)
    assert 30 <= moved <= 90  # about half
