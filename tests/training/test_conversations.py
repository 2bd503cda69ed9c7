"""Conversation files for drafter training (training/data/): the LLaVA / ShareGPT4V format read from a JSON list or
JSONL, every bad record named before training, images placed at their markers, and the world exported as a file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PIL import Image

import specula.training.data.conversations as conversations
from specula.training.data import (Conversation, DataError, Turn, exchanges, load_conversations, load_images,
                                   read_conversations, to_messages, to_record, validate, world_samples,
                                   write_records, write_world_conversations)
from specula.training.data.messages import content_parts
from specula.world import generate, placed
from specula.world.suites import _rng, _vqa_dialogue
from specula.world.tokenizer import format_dialogue, format_turns


def _png(path: Path, colour=(255, 0, 0), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (8, 6), colour if mode == "RGB" else 128).save(path)
    return path


def _write(path: Path, records: list, jsonl: bool) -> Path:
    text = "\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records, indent=2)
    path.write_text(text, encoding="utf-8")
    return path


RECORDS = [
    {"id": "000000033471", "image": "coco/a.png",
     "conversations": [{"from": "human", "value": "<image>\nWhat are the colors of the bus?"},
                       {"from": "gpt", "value": "The bus is white and red."},
                       {"from": "human", "value": "Is it moving?"}, {"from": "gpt", "value": "No."}]},
    {"id": 7, "image": ["coco/a.png", "b.png"],  # int id, a list of images, markers at the end / mid-turn
     "conversations": [{"from": "system", "value": "Be brief."},
                       {"from": "user", "value": "Compare the first\n<image>\nwith <image>"},
                       {"from": "assistant", "value": "Same bus."}]},
    {"id": "text-1", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]


@pytest.fixture()
def images(tmp_path):
    _png(tmp_path / "coco" / "a.png")
    _png(tmp_path / "b.png", mode="L")  # not RGB: load_images converts
    return tmp_path


@pytest.mark.parametrize("jsonl", [False, True], ids=["json", "jsonl"])
def test_a_file_reads_into_conversations_and_writes_back(images, jsonl):
    path = _write(images / ("data.jsonl" if jsonl else "data.json"), RECORDS, jsonl)
    convs = read_conversations(path, progress=False)  # image root: the file's folder
    assert [c.id for c in convs] == ["000000033471", "7", "text-1"]
    assert convs[0].images == (images / "coco" / "a.png",)
    assert convs[1].images == (images / "coco" / "a.png", images / "b.png")
    assert convs[2].images == ()
    assert convs[0].turns == (Turn("user", "<image>\nWhat are the colors of the bus?"),
                              Turn("assistant", "The bus is white and red."), Turn("user", "Is it moving?"),
                              Turn("assistant", "No."))
    assert [t.role for t in convs[1].turns] == ["system", "user", "assistant"]
    assert [c.index for c in convs] == [0, 1, 2] and {c.source for c in convs} == {str(path)}

    again = write_records(images / ("copy.jsonl" if not jsonl else "copy.json"),
                          [to_record(c, images) for c in convs], progress=False)
    assert again == 3
    back = read_conversations(images / ("copy.jsonl" if not jsonl else "copy.json"), progress=False)
    assert [dataclasses.replace(c, source="") for c in back] == [dataclasses.replace(c, source="") for c in convs]


def test_the_format_is_told_by_content_not_by_the_name(images):
    as_list = _write(images / "list.jsonl", RECORDS, jsonl=False)  # a JSON list named .jsonl
    as_lines = _write(images / "lines.json", RECORDS, jsonl=True)  # JSONL named .json
    assert read_conversations(as_list, progress=False)[1].id == read_conversations(as_lines, progress=False)[1].id
    lines = images / "with_blank_lines.jsonl"
    lines.write_text("\ufeff" + "\n\n".join(json.dumps(r) for r in RECORDS) + "\n\n")  # a BOM and blank lines
    assert len(read_conversations(lines, progress=False)) == 3


def test_a_large_json_list_is_read_record_by_record(tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "_CHUNK", 53)  # records far bigger than the buffer
    recs = [{"id": i, "conversations": [{"from": "human", "value": "q" * (i % 200)},
                                        {"from": "gpt", "value": "line\n" * (i % 30 + 1)}]} for i in range(300)]
    path = _write(tmp_path / "big.json", recs, jsonl=False)
    convs = read_conversations(path, progress=False)
    assert [c.turns[1].text for c in convs] == [r["conversations"][1]["value"] for r in recs]
    lines = path.read_text().splitlines()
    found = {i: line for i, line, _ in conversations._records(path, conversations._Problems(), False)}
    assert all(lines[found[i] - 1].strip() == "{" for i in (0, 1, 150, 299))
    assert lines[found[1] - 2].strip() == "},"


GOOD_TURNS = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A bus."}]
BAD = {  # record -> what the error must say
    "not an object": ("just text", ["record 0", "no id", "is a JSON string, not an object"]),
    "no conversations": ({"id": "r1", "image": "a.png"}, ["'r1'", 'has no "conversations"']),
    "conversations empty": ({"id": "r2", "conversations": []}, ["'r2'", '"conversations" is empty']),
    "conversations not a list": ({"id": "r3", "conversations": "hi"}, ["'r3'", "not a list of turns"]),
    "unknown role": ({"id": "r4", "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
                     ["'r4'", "turn 1 has role 'bot'", "use human/user, gpt/assistant or system"]),
    "no from": ({"id": "r5", "conversations": [{"value": "hi"}, {"from": "gpt", "value": "x"}]},
                ["'r5'", 'turn 0 has no "from"']),
    "value not text": ({"id": "r6", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
                       ["'r6'", "turn 0 has no text", "a JSON number"]),
    "two user turns": ({"id": "r7", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                                      {"from": "gpt", "value": "c"}]},
                       ["'r7'", "turn 1 is a user turn after a user turn", "alternate"]),
    "starts with gpt": ({"id": "r8", "conversations": [{"from": "gpt", "value": "Hello!"},
                                                       {"from": "human", "value": "hi"}]},
                        ["'r8'", "turn 0 is an assistant turn at the start", "starts with a human turn"]),
    "system not first": ({"id": "r9", "conversations": [*GOOD_TURNS[1:], {"from": "system", "value": "s"}]},
                         ["'r9'", "turn 0 is an assistant turn"]),
    "late system": ({"id": "r9b", "image": "a.png", "conversations": [*GOOD_TURNS, {"from": "system", "value": "s"}]},
                    ["'r9b'", "turn 2 is a system turn after an assistant turn", "may only come first"]),
    "no answer": ({"id": "r10", "conversations": [{"from": "human", "value": "hi"}]},
                  ["'r10'", "has no gpt (assistant) turn"]),
    "empty answer": ({"id": "r11", "image": "a.png", "conversations": [GOOD_TURNS[0], {"from": "gpt", "value": " "}]},
                     ["'r11'", "turn 1 is an empty answer"]),
    "more markers than images": ({"id": "r12", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image><image>Same?"}, GOOD_TURNS[1]]},
        ["'r12'", "has 2 <image> markers but 1 image", "one <image> per image"]),
    "marker without image": ({"id": "r13", "conversations": GOOD_TURNS}, ["'r13'", "1 <image> marker but 0 images"]),
    "image without marker": ({"id": "r14", "image": "a.png", "conversations": [{"from": "human", "value": "What?"},
                                                                              GOOD_TURNS[1]]},
                             ["'r14'", "has 1 image but no <image> marker", "at the start of the first human turn"]),
    "marker in an answer": ({"id": "r15", "image": "a.png", "conversations": [
        {"from": "human", "value": "Show it"}, {"from": "gpt", "value": "<image>"}]},
        ["'r15'", "turn 1 (assistant) holds an <image> marker", "images belong in human turns"]),
    "image missing": ({"id": 16, "image": "missing/x.png", "conversations": GOOD_TURNS},
                      ["'16'", "image 'missing/x.png' is not found", "--image-root"]),
    "image not a path": ({"id": "r17", "image": {"path": "a.png"}, "conversations": GOOD_TURNS},
                         ["'r17'", '"image" must be a path or a list of paths']),
    "bad id": ({"id": [1], "image": "a.png", "conversations": GOOD_TURNS}, ['"id" is a JSON list']),
    "unanswered image turn": ({"id": "r18", "image": "a.png", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "<image>"}]},
        ["'r18'", "unanswered human turn with an <image> marker"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("jsonl", [False, True], ids=["json", "jsonl"])
def test_every_bad_record_is_a_data_error_that_names_it(tmp_path, case, jsonl):
    _png(tmp_path / "a.png")
    rec, wants = BAD[case]
    path = _write(tmp_path / "data.json", [rec], jsonl)
    with pytest.raises(DataError) as err:
        read_conversations(path, progress=False)
    msg = str(err.value)
    assert msg.startswith("1 bad record in"), msg
    assert f"{path}: record 0" in msg and "docs/training-data.md" in msg
    for want in wants:
        assert want in msg, f"{want!r} not in {msg}"
    assert err.value.n_bad == 1 and isinstance(err.value, ValueError)
    if jsonl:
        assert "(line 1)" in msg


def test_an_unanswered_last_question_is_dropped(tmp_path):
    turns = [*GOOD_TURNS, {"from": "human", "value": "And now?"}]
    _png(tmp_path / "a.png")
    conv, = read_conversations(_write(tmp_path / "d.json", [{"id": 1, "image": "a.png", "conversations": turns}],
                                      False), progress=False)
    assert [t.role for t in conv.turns] == ["user", "assistant"]


@pytest.mark.parametrize("content,want", [
    (None, "not found"),
    ("", "is empty"),
    ("   \n", "is empty"),
    ("id,conversations\n1,hi\n", "is not JSON (it starts with 'i')"),
    ('{\n  "data": [{"id": 1, "conversations": []}]\n}\n', "its 'data' key holds a list of records"),
    ('[{"id": 1, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},\n'
     '{"id": 2, "conversations": [', "the file ends inside a record (was it cut short?) at line 2 (in record 1)"),
    ('[{"id": 1, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}\n{"id": 2}]',
     "expected ',' or ']' between records at line 2"),
    ("[]", "holds no records"),
])
def test_a_file_that_is_not_a_conversation_file_says_why(tmp_path, content, want):
    path = tmp_path / "d.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as err:
        read_conversations(path, progress=False)
    assert want in str(err.value) and str(path) in str(err.value), str(err.value)


def test_a_broken_jsonl_line_is_one_bad_record_and_reading_goes_on(tmp_path):
    good = json.dumps({"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]})
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n{{\"id\": \"cut\", \"conv\n{good}\n{{\"id\": \"r\", \"conversations\": []}}\n")
    with pytest.raises(DataError) as err:
        read_conversations(path, progress=False)
    msg = str(err.value)
    assert msg.startswith("2 bad records")
    assert "record 1 (line 2), no id: line 2 is not valid JSON" in msg
    assert "record 3 (line 4), id 'r': \"conversations\" is empty" in msg


def test_every_problem_is_reported_at_once(tmp_path):
    """Like a compiler: all bad records in one error, the good ones not mentioned; max_errors caps what is shown."""
    _png(tmp_path / "a.png")
    good = {"id": "good", "image": "a.png", "conversations": GOOD_TURNS}
    recs = [good, BAD["unknown role"][0], good, BAD["image missing"][0], BAD["more markers than images"][0], good]
    path = _write(tmp_path / "d.jsonl", recs, jsonl=True)
    with pytest.raises(DataError) as err:
        read_conversations(path, progress=False)
    msg = str(err.value)
    assert msg.startswith(f"3 bad records in {path}")
    assert "record 1 (line 2), id 'r4': turn 1 has role 'bot'" in msg
    assert "record 3 (line 4), id '16': image 'missing/x.png' is not found" in msg
    assert "record 4 (line 5), id 'r12': has 2 <image> markers but 1 image" in msg
    assert "'good'" not in msg and len(err.value.problems) == 3
    with pytest.raises(DataError) as err:
        read_conversations(path, max_errors=2, progress=False)
    assert "... and 1 more problems (the first 2 shown)" in str(err.value)
    assert "id 'r12'" not in str(err.value)


def test_image_files_are_opened_before_training(tmp_path):
    _png(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (tmp_path / "notes.png").write_text("I am text")
    recs = [{"id": "fine", "image": "a.png", "conversations": GOOD_TURNS},
            {"id": "broken", "image": "broken.png", "conversations": GOOD_TURNS},
            {"id": "text", "image": ["a.png", "notes.png"], "conversations": [
                {"from": "human", "value": "<image><image>"}, GOOD_TURNS[1]]},
            BAD["unknown role"][0]]
    path = _write(tmp_path / "d.json", recs, jsonl=False)
    with pytest.raises(DataError) as err:
        load_conversations(path, progress=False)  # file rules and image headers in one error
    msg = str(err.value)
    assert msg.startswith("3 bad records")
    assert "id 'broken': image" in msg and "broken.png cannot be read" in msg
    assert "id 'text': image" in msg and "notes.png cannot be read" in msg
    assert "id 'r4': turn 1 has role 'bot'" in msg and "'fine'" not in msg
    convs = read_conversations(_write(tmp_path / "e.json", recs[:3], jsonl=False), progress=False)  # headers unread
    with pytest.raises(DataError, match="id 'broken'"):
        validate(convs, check_images=True, progress=False)
    validate(convs, check_images=False, progress=False)
    with pytest.raises(DataError, match="id 'broken'"):
        load_images(convs[1])


def test_over_long_turns_and_conversations_are_found(tmp_path, processor):
    long_q = "What colour is the red circle? " * 20
    recs = [{"id": "short", "conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hi."}]},
            {"id": "long_turn", "conversations": [{"from": "human", "value": long_q},
                                                  {"from": "gpt", "value": "Red."}]},
            {"id": "long_talk", "conversations": [{"from": "human", "value": "Hi. " * 15},
                                                  {"from": "gpt", "value": "Hi. " * 15}] * 3}]
    path = _write(tmp_path / "d.json", recs, jsonl=False)
    n_long = len(processor.tokenizer(long_q, add_special_tokens=False)["input_ids"])
    assert n_long > 100
    with pytest.raises(DataError) as err:
        load_conversations(path, tokenizer=processor, max_tokens=100, progress=False)
    msg = str(err.value)
    assert msg.startswith("2 bad records")
    assert f"id 'long_turn': turn 0 (user) is {n_long} tokens, over the limit of 100" in msg
    assert "id 'long_turn': the whole conversation is" in msg
    assert "id 'long_talk': the whole conversation is" in msg and "id 'long_talk': turn" not in msg
    assert "'short'" not in msg
    load_conversations(path, tokenizer=processor.tokenizer, max_tokens=1000, progress=False)
    # images count toward the limit: one image of 144 tokens puts a short record over 100
    _png(tmp_path / "a.png")
    one = _write(tmp_path / "i.json", [{"id": "img", "image": "a.png", "conversations": GOOD_TURNS}], jsonl=False)
    load_conversations(one, tokenizer=processor, max_tokens=100, progress=False)
    with pytest.raises(DataError, match=r"id 'img': turn 0 \(user\) is 1\d\d tokens"):
        load_conversations(one, tokenizer=processor, max_tokens=100, tokens_per_image=144, progress=False)


def test_messages_put_each_image_where_its_marker_was(images):
    convs = read_conversations(_write(images / "d.json", RECORDS, jsonl=False), progress=False)
    assert to_messages(convs[0]) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What are the colors of the bus?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The bus is white and red."}]},
        {"role": "user", "content": [{"type": "text", "text": "Is it moving?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "No."}]}]
    assert to_messages(convs[1]) == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare the first"}, {"type": "image"},
                                     {"type": "text", "text": "with "}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Same bus."}]}]
    assert content_parts("Q\n<image>") == [{"type": "text", "text": "Q"}, {"type": "image"}]
    assert content_parts("<image><image>Q") == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Q"}]
    assert content_parts("Q <image>") == [{"type": "text", "text": "Q "}, {"type": "image"}]  # spaces are kept

    first, second = exchanges(convs[0])
    assert (first.answer, first.n_images, first.turn) == ("The bus is white and red.", 1, 1)
    assert first.messages == to_messages(convs[0])[:1]
    assert (second.answer, second.n_images, second.turn) == ("No.", 1, 3)
    assert second.messages == to_messages(convs[0])[:3]
    assert [e.n_images for e in exchanges(convs[1])] == [2] and exchanges(convs[2])[0].n_images == 0

    pics = load_images(convs[1])
    assert [p.mode for p in pics] == ["RGB", "RGB"] and pics[0].getpixel((0, 0)) == (255, 0, 0)
    assert pics[1].getpixel((0, 0)) == (128, 128, 128)


def _world_samples():
    yield from world_samples(["caption", "multi_image", "video", "chart", "ocr", "text"], n=2)
    base = generate("vqa", "train", 5)
    yield "vqa-system", placed.variant(base, "system")
    yield "vqa-question-first", placed.variant(base, "question_first")  # "Question <image>"
    yield "vqa-dialogue", _vqa_dialogue(_rng("vqa_dialogue", "train", 0, 0), "vqa_dialogue", "vqa")  # follow-ups


@pytest.mark.parametrize("name", ["world.jsonl", "world.json"])
def test_the_world_exported_reads_back_and_renders_as_the_world_does(tmp_path, processor, name):
    """The embedded chat template renders the messages of an exported sample exactly as format_turns /
    format_dialogue write the world's own prompts: system turn, image parts and follow-ups included."""
    samples = list(_world_samples())
    assert any(s.system for _, s in samples) and any(s.followups for _, s in samples)
    assert any(not s.images for _, s in samples) and any(len(s.images) > 1 for _, s in samples)
    out = tmp_path / "export" / name
    assert write_world_conversations(out, tmp_path / "export" / "images", samples, progress=False) == len(samples)
    convs = load_conversations(out, check_images=True, progress=False)  # --image-root: the file's folder
    assert [c.id for c in convs] == [rid for rid, _ in samples]
    for conv, (rid, s) in zip(convs, samples):
        assert len(conv.images) == len(s.images)
        for path, im in zip(conv.images, s.images):
            assert path.parent == tmp_path / "export" / "images"
            assert Image.open(path).tobytes() == im.convert("RGB").tobytes()
        first = exchanges(conv)[0]
        text = processor.apply_chat_template(first.messages, tokenize=False, add_generation_prompt=True)
        assert text == format_turns(s.prompt, system=s.system), rid
        assert first.answer == s.response and first.n_images == len(s.images)
        whole = processor.apply_chat_template(to_messages(conv), tokenize=False)
        assert whole == format_dialogue(s.prompt, s.response, s.followups, s.system), rid
        assert [e.answer for e in exchanges(conv)] == [s.response, *(a for _, a in s.followups)]
    # the exported text tokenises as the world's does, image tokens expanded alike
    conv, (_, s) = convs[0], samples[0]
    text = processor.apply_chat_template(exchanges(conv)[0].messages, tokenize=False, add_generation_prompt=True)
    got = processor(text=text, images=load_images(conv), return_tensors="pt")["input_ids"]
    want = processor(text=format_turns(s.prompt), images=list(s.images), return_tensors="pt")["input_ids"]
    assert got.tolist() == want.tolist()


def test_conversations_are_frozen():
    conv = Conversation("x", (), (Turn("user", "hi"), Turn("assistant", "yo")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        conv.id = "y"  # type: ignore[misc]


def test_text_that_is_not_utf8_is_named(tmp_path):
    good = json.dumps({"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]})
    lines = tmp_path / "d.jsonl"
    lines.write_bytes(f"{good}\n".encode() + b'{"id": "latin", "value": "caf\xe9"}\n' + f"{good}\n".encode())
    with pytest.raises(DataError, match=r"record 1 \(line 2\), no id: line 2 is not UTF-8 text"):
        read_conversations(lines, progress=False)
    listed = tmp_path / "d.json"
    listed.write_bytes(b"[" + (good + ",\n").encode() * 3 + b'{"id": "caf\xe9"}]')
    with pytest.raises(DataError, match="is not UTF-8 text"):
        read_conversations(listed, progress=False)


def test_image_paths_are_relative_to_the_image_root(tmp_path, images):
    (tmp_path / "elsewhere").mkdir()
    data = _write(tmp_path / "elsewhere" / "d.json", RECORDS, jsonl=False)
    with pytest.raises(DataError, match="image 'coco/a.png' is not found"):  # default root: the file's folder
        read_conversations(data, progress=False)
    assert read_conversations(data, image_root=images, progress=False)[0].images == (images / "coco" / "a.png",)
    assert len(read_conversations(data, check_files=False, progress=False)) == 3
    with pytest.raises(DataError, match="the image root .*nowhere is not a folder"):
        read_conversations(data, image_root=tmp_path / "nowhere", progress=False)
    absolute = _write(tmp_path / "elsewhere" / "abs.json", [{**RECORDS[0], "image": str(images / "coco" / "a.png")}],
                      jsonl=False)
    assert read_conversations(absolute, progress=False)[0].images == (images / "coco" / "a.png",)
