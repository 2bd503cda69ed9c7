"""The embedded world: deterministic, well-formed, disjoint train/eval, with real language entropy."""

import hashlib
from collections import Counter

import pytest

from specula.world import GRID, IMAGE_SIZE, SUITES, generate, generate_many
from specula.world.suites import train_stream


def _digest(sample) -> str:
    h = hashlib.sha256()
    for im in sample.images:
        h.update(im.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("suite", list(SUITES))
def test_same_index_gives_same_sample(suite):
    a, b = generate(suite, "eval", 7), generate(suite, "eval", 7)
    assert (a.prompt, a.response, a.answer) == (b.prompt, b.response, b.answer)
    assert _digest(a) == _digest(b)
    c = generate(suite, "eval", 7, seed=1)
    assert (c.prompt, c.response, _digest(c)) != (a.prompt, a.response, _digest(a))


@pytest.mark.parametrize("suite", list(SUITES))
def test_samples_are_well_formed(suite):
    for s in generate_many(suite, 30):
        assert s.prompt.count("<image>") == len(s.images)
        assert s.response.strip()
        for im in s.images:
            assert im.size == (IMAGE_SIZE, IMAGE_SIZE) and im.mode == "RGB"
        assert len(s.patch_words) == len(s.images)
        assert all(len(pw) == GRID * GRID for pw in s.patch_words)
        if SUITES[suite].task in ("qa", "vqa"):
            assert s.answer and s.n_choices and s.n_choices >= 2
        if suite == "caption":
            assert s.attributes and all(a in s.response for a in s.attributes)


def test_image_counts_per_suite():
    multi = [len(s.images) for s in generate_many("multi_image", 80)]
    video = [len(s.images) for s in generate_many("video", 80)]
    assert min(multi) >= 2 and max(multi) <= 5 and len(set(multi)) >= 3
    assert min(video) >= 4 and max(video) <= 8 and len(set(video)) >= 3
    assert all(len(s.images) == 0 for s in generate_many("text", 20))


def test_eval_suites_disjoint_from_training():
    eval_hashes = {_digest(s) for name in SUITES if name != "text" for s in generate_many(name, 60)}
    stream = train_stream()
    train_hashes = {_digest(next(stream)) for _ in range(1500)}
    train_hashes.discard(hashlib.sha256().hexdigest())  # text-only samples have no image bytes
    assert not (eval_hashes & train_hashes)


def test_language_has_entropy():
    captions = [s.response for s in generate_many("caption", 100)]
    assert len(set(captions)) == 100
    openings = Counter(c.split()[0] for c in captions)
    assert len(openings) >= 4  # several paraphrase templates in use
    prompts = {s.prompt.split("?")[0] for s in generate_many("vqa", 200)}
    assert len(prompts) >= 60


def test_yes_no_answers_are_balanced():
    answers = [s.answer for s in generate_many("vqa", 600) if s.answer in ("yes", "no")]
    assert len(answers) >= 60
    share = answers.count("yes") / len(answers)
    assert 0.3 <= share <= 0.7, share


def test_patch_words_follow_the_objects():
    s = generate("vqa", "eval", 50063)  # the bundled sample image: blue star, purple triangle, two squares
    words = {w for pw in s.patch_words[0] for w in pw}
    assert {"blue", "star", "purple", "triangle", "green", "orange", "square"} <= words
    assert sum(1 for pw in s.patch_words[0] if not pw) > 72  # mostly background


def test_unknown_suite_and_split_rejected():
    with pytest.raises(ValueError, match="unknown suite"):
        generate("nope")
    with pytest.raises(ValueError, match="split"):
        generate("vqa", "test")


def test_captions_scan_every_cell_in_reading_order():
    """The listing names the nine cells in reading order, each with exactly the objects in it (``scan_listing``)."""
    import random

    from specula.world.scene import SCAN_OPENERS, sample_scene, scan_listing
    from specula.world.vocab import POSITIONS

    for i in range(40):
        scene = sample_scene(random.Random(f"scan/{i}"))
        entries = scan_listing(scene).split("; ")
        assert [e.split(", ")[0] for e in entries] == list(POSITIONS.values())
        for (cell, _), entry in zip(POSITIONS.items(), entries):
            here = [o for o in scene.objects if o.cell == cell]
            said = entry.split(", ", 1)[1]
            assert (said == "no object") == (not here)
            assert all(f"{o.size} {o.colour} {o.shape}" in said for o in here) and said.count(" and ") == max(0, len(here) - 1)
    # the scan mix answers the evaluation suite's caption prompts cell by cell, with the same random stream
    from specula.world.suites import MIXES

    scan = {name: maker for name, maker, _, _ in MIXES["confusable_scan"]}
    plain = {name: maker for name, maker, _, _ in MIXES["confusable"]}
    assert scan.keys() == plain.keys()
    for i in range(20):
        a = scan["caption"](random.Random(f"scan-mix/{i}"), "caption", "caption")
        b = plain["caption"](random.Random(f"scan-mix/{i}"), "caption", "caption")
        assert a.prompt == b.prompt and a.attributes == b.attributes and a.response != b.response
        assert any(a.response.lower().startswith(f"{o}: top left, ") for o in SCAN_OPENERS), a.response
        assert a.response.split(". ", 1)[1:] == b.response.split(". ", 1)[1:]  # background and relations as before


def test_captions_by_colour_name_every_colour_with_its_objects():
    """The colour listing names the eight colours in a fixed order, each with exactly its objects (size, shape and
    cell, in reading order) or "no object"; the colour_captions mix is scan_captions with these captions, drawing the
    same random stream (same prompt, attributes, background and relation sentences)."""
    import random

    from specula.world.scene import colour_listing, sample_scene
    from specula.world.suites import MIXES
    from specula.world.vocab import COLOUR_NAMES, POSITIONS

    for i in range(40):
        scene = sample_scene(random.Random(f"colours/{i}"))
        entries = colour_listing(scene).split("; ")
        assert [e.split(", ")[0] for e in entries] == list(COLOUR_NAMES)
        for colour, entry in zip(COLOUR_NAMES, entries):
            mine = sorted((o for o in scene.objects if o.colour == colour), key=lambda o: o.cell)
            said = entry.split(", ", 1)[1]
            if not mine:
                assert said == "no object"
                continue
            phrases = said.split(" and ")
            assert len(phrases) == len(mine)
            for o, p in zip(mine, phrases):
                assert p.startswith(f"a {o.size} {o.shape} ") or p.startswith(f"an {o.size} {o.shape} "), p
                assert p.endswith("in the center" if o.cell == (1, 1) else f"at the {POSITIONS[o.cell]}"), p
    by_colour = {name: (maker, w) for name, maker, _, w in MIXES["colour_captions"]}
    by_cell = {name: (maker, w) for name, maker, _, w in MIXES["scan_captions"]}
    assert by_colour.keys() == by_cell.keys()
    for name, (maker, w) in by_cell.items():
        assert by_colour[name][1] == w and (by_colour[name][0] is maker) == (not name.startswith("caption")), name
    for name in ("caption", "caption_short"):
        for i in range(10):
            a = by_colour[name][0](random.Random(f"colour-mix/{i}"), "caption", "caption")
            b = by_cell[name][0](random.Random(f"colour-mix/{i}"), "caption", "caption")
            assert a.prompt == b.prompt and a.attributes == b.attributes
            assert a.response.split(": ", 1)[1].startswith("red, ") and a.response != b.response
            assert a.response.split(". ", 1)[1:] == b.response.split(". ", 1)[1:]


def test_captions_list_objects_in_reading_order():
    """Scene captions name their objects cell by cell, top row first (world/scene.py ``caption``)."""
    from specula.world.vocab import POSITIONS

    cell_of = {where: cell for cell, where in POSITIONS.items()}
    checked = 0
    for s in generate_many("caption", 60):
        visible = {w for w in s.patch_words[0] if w}  # (colour, shape, size, *place words) per visible object
        objects = {(w[0], w[1]): cell_of[" ".join(w[3:])] for w in visible}
        pairs = list(zip(s.attributes[::2], s.attributes[1::2]))
        if len(pairs) < 2 or set(pairs) != set(objects):
            continue  # a fully hidden object: its cell is not in the patch words
        text = s.response.lower()
        first = sorted(pairs, key=lambda p: text.index(f"{p[0]} {p[1]}"))
        assert first == sorted(pairs, key=lambda p: objects[p]), s.response
        checked += 1
    assert checked >= 20


def test_caption_order_leaves_the_random_stream_alone():
    """Listing in reading order draws the same random numbers as the shuffled order did, so every pick after the
    caption (the prompt's included) is unchanged: the evaluation suite keeps its prompts (digest taken before the
    change)."""
    prompts = "\n".join(s.prompt for s in generate_many("caption", 50))
    assert hashlib.sha256(prompts.encode()).hexdigest() == (
        "01ec381fb78a9c2b730199089470c0b09a80e946a8ecba55531cdfa131a79f07")


def test_describe_mix_is_the_dialogue_mix_with_twice_the_captions():
    from specula.world.suites import MIXES

    dialogue = {name: w for name, _, _, w in MIXES["dialogue"]}
    describe = {name: w for name, _, _, w in MIXES["describe"]}
    assert describe.keys() == dialogue.keys()
    for name, w in dialogue.items():
        assert describe[name] == (2 * w if name in ("caption", "caption_short") else w), name


def test_scan_captions_mix_is_the_scan_mix_with_twice_the_captions():
    from specula.world.suites import MIXES

    scan = {name: (maker, w) for name, maker, _, w in MIXES["confusable_scan"]}
    heavy = {name: (maker, w) for name, maker, _, w in MIXES["scan_captions"]}
    assert heavy.keys() == scan.keys()
    for name, (maker, w) in scan.items():
        assert heavy[name] == (maker, 2 * w if name in ("caption", "caption_short") else w), name
    share = sum(w for name, (_, w) in heavy.items() if name.startswith("caption")) / sum(w for _, w in heavy.values())
    assert 0.35 < share < 0.45


def test_confusable_scenes_name_objects_by_colour_and_shape():
    import random

    from specula.world.scene import _ref, sample_confusable_scene, sample_scene

    both = plain = 0
    for i in range(200):
        s = sample_confusable_scene(random.Random(f"confusable/{i}"))
        pairs = [(o.colour, o.shape) for o in s.objects]
        assert 3 <= len(pairs) <= 5 and len(set(pairs)) == len(pairs)
        assert len({c for c, _ in pairs}) <= 3 and len({sh for _, sh in pairs}) <= 3
        both += sum(_ref(o, s) == o.name for o in s.objects)
        p = sample_scene(random.Random(f"confusable/{i}"), 3, 5)
        plain += sum(_ref(o, p) == o.name for o in p.objects)
    assert both > 4 * plain  # most objects need both words; in ordinary scenes few do
    with pytest.raises(ValueError, match="distinct"):
        sample_scene(random.Random(0), 1, 5, colours=("red",), shapes=("square", "circle"))


def test_confusable_mix_adds_confusable_dialogues_to_the_describe_mix():
    import random

    from specula.world.suites import MIXES

    describe = {name: w for name, _, _, w in MIXES["describe"]}
    confusable = {name: (maker, task, w) for name, maker, task, w in MIXES["confusable"]}
    assert {k: v[2] for k, v in confusable.items() if k in describe} == describe
    maker, task, _ = confusable["vqa_dialogue_confusable"]
    s = maker(random.Random("confusable-dialogue"), "vqa_dialogue_confusable", task)
    assert s.kind == "vqa_dialogue" and len(s.images) == 1 and len(s.followups) >= 6
    scenes = {name: w for name, _, _, w in MIXES["scenes"]}
    hard = {name: (maker, w) for name, maker, _, w in MIXES["scenes_confusable"]}
    assert {k: v[1] for k, v in hard.items() if k in scenes} == scenes
    assert hard["vqa_dialogue_confusable"][0] is maker
