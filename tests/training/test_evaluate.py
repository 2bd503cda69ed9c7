"""``specula zoo eval``'s report: the gate keys and the per-question-type breakdown (image vs blank)."""

import pytest
import torch

from specula.targets.processor import load_processor
from specula.world import generate
from specula.training.target.evaluate import EVAL_OFFSET, evaluate
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.quality import answers_by_type, attribute_recall, by_question_type, which_image_by_place
from specula.targets.embedded_arch import TargetArch, build_model


def test_vqa_samples_carry_their_question_type():
    kinds = {generate("vqa", "eval", i).kind for i in range(120)}
    assert kinds == {f"vqa/{t}" for t in ("colour", "shape", "count", "count_colour", "exists", "size", "relation",
                                         "where")}


def test_by_question_type_counts_each_type():
    samples = [generate("vqa", "eval", i) for i in range(40)]
    hits = [i % 2 == 0 for i in range(40)]
    blank = [False] * 40
    out = by_question_type(samples, hits, blank)
    assert sum(r["n"] for r in out.values()) == 40
    for qtype, r in out.items():
        mine = [h for s, h in zip(samples, hits) if s.kind == f"vqa/{qtype}"]
        assert r["exact"] == pytest.approx(sum(mine) / len(mine)) and r["exact_blank_image"] == 0


def test_which_image_by_place_tells_reading_the_first_image_from_reading_the_asked_one():
    samples = [s for s in (generate("multi_image", "eval", i) for i in range(200)) if s.kind == "multi/which"]
    first = [next(w[0] for w in s.patch_words[0] if w) for s in samples]
    right = which_image_by_place(samples, [s.answer for s in samples])
    assert sum(r["n"] for r in right.values()) == len(samples) and {"first", "second", "third"} <= set(right)
    assert all(r["exact"] == 1.0 for r in right.values()) and right["first"]["first_image_colour"] == 1.0
    stuck = which_image_by_place(samples, first)  # an LM that answers the first image's colour whatever is asked
    assert stuck["first"]["exact"] == 1.0 and all(r["first_image_colour"] == 1.0 for r in stuck.values())
    later = [r["exact"] for place, r in stuck.items() if place != "first"]
    assert max(later) < 0.5  # right for a later image only where its colour happens to be the first's


def test_answers_by_type_tells_an_unlearnt_format_from_a_prior():
    samples = [s for s in (generate("multi_image", "eval", i) for i in range(120)) if s.kind in ("multi/odd",
                                                                                               "multi/count")]
    odd = [s for s in samples if s.kind == "multi/odd"]
    # odd-one-out questions answered with a shape (off the ordinals), counting questions always "one" (a prior)
    answers = ["star" if s.kind == "multi/odd" else "one" for s in samples]
    out = answers_by_type(samples, answers)
    assert out["odd"] == {"n": len(odd), "top": {"star": len(odd)}, "in_answer_set": 0.0}
    count = [s for s in samples if s.kind == "multi/count"]
    assert out["count"]["top"] == {"one": len(count)} and out["count"]["in_answer_set"] == 1.0
    right = answers_by_type(samples, [s.answer for s in samples], top=2)
    assert all(r["in_answer_set"] == 1.0 and len(r["top"]) <= 2 for r in right.values())
    assert sum(right["odd"]["top"].values()) <= len(odd) and len({s.answer for s in odd}) > 2


def test_evaluate_reports_gate_keys_and_types():
    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval()
    torch.set_num_threads(1)
    r = evaluate(model, processor, n=6, suites=["vqa", "caption", "chart", "multi_image"])
    assert {"vqa_exact", "vqa_exact_blank_image", "vqa_chance", "caption_attribute_recall", "gates"} <= set(r)
    for form in ("lead", "question_first", "system"):  # the same questions with the image off the prompt's start
        assert r[f"vqa_exact_{form}"] == r["suites"]["vqa"][f"exact_{form}"]
    only = evaluate(model, processor, n=2, suites=["vqa"], forms=("lead",))
    assert "vqa_exact_lead" in only and "vqa_exact_system" not in only
    types = r["suites"]["vqa"]["by_type"]
    assert sum(t["n"] for t in types.values()) == 6
    assert "by_type" in r["suites"]["chart"]  # chart kinds are "chart/<question>" too
    by_question = r["suites"]["chart"]["by_question"]  # ... and each chart kind by its question type
    assert sum(t["n"] for t in by_question.values()) == 6
    assert all(q.split()[0] in ("bar", "line", "pie") and len(q.split()) == 2 for q in by_question)
    places = r["suites"]["multi_image"]["which_by_place"]  # image sets: "which" questions by the asked image
    which = sum(s.kind == "multi/which" for s in (generate("multi_image", "eval", EVAL_OFFSET + i) for i in range(6)))
    assert sum(t["n"] for t in places.values()) == which
    said = r["suites"]["multi_image"]["answers_by_type"]  # what it answers per type, beside how often it is right
    assert {t: a["n"] for t, a in said.items()} == {t: b["n"] for t, b in r["suites"]["multi_image"]["by_type"].items()}


def test_scene_objects_counts_the_shapes_of_a_described_scene():
    from research.probe import scene_objects

    assert scene_objects("Imagine a large red circle in the top left and a small blue star, and a green cross in "
                         "the center. What colour is the star?") == 3
    assert scene_objects("Imagine a small black triangle in the bottom right. Where is the triangle?") == 1


def test_probe_reports_real_oracle_and_described():
    from research.probe import oracle_visual, probe

    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval()
    torch.set_num_threads(1)
    r = probe(model, processor, n=4)
    assert sum(t["n"] for t in r["by_type"].values()) == 4 and r["described_n"] >= 1
    assert 0 <= r["real"] <= 1 and 0 <= r["oracle"] <= 1
    split = r["described_by_objects"]  # the described-scene accuracy, split by objects in the scene
    assert sum(t["n"] for t in split.values()) == r["described_n"] and all(k >= 1 for k in split)
    assert r["described"] == pytest.approx(sum(t["n"] * t["exact"] for t in split.values()) / r["described_n"])
    # oracle tokens: object patches become their words' embedding direction, background patches stay
    real = torch.randn(3, model.config.text_config.hidden_size)
    out = oracle_visual(model, [[5, 6], [], [7]], real)
    assert torch.equal(out[1], real[1])
    want = model.get_input_embeddings().weight[[5, 6]].sum(0)
    assert torch.nn.functional.cosine_similarity(out[0], want, dim=0) > 0.999
    assert torch.allclose(out[2].pow(2).mean(), real[2].pow(2).mean(), rtol=1e-4)
    assert set(r["word_embeddings"]) == {"colour", "shape", "size", "place"}
    assert sum(t["n"] for t in r["real_by_objects"].values()) == 4
    assert r["real"] == pytest.approx(sum(t["n"] * t["exact"] for t in r["real_by_objects"].values()) / 4)
    assert set(r["lookup_errors"]) == {"right", "other_object", "absent"}


def test_classify_lookup_tells_selection_from_reading_errors():
    from specula.world.suites import generate
    from research.probe import LOOKUP_SLOTS, classify_lookup, image_objects

    found = 0
    for i in range(200):
        s = generate("vqa", "eval", EVAL_OFFSET + i, 0)
        kind = s.kind.split("/")[-1]
        objs = image_objects(s)
        if kind not in LOOKUP_SLOTS or len({w[:2] for w in objs}) < 2:
            assert kind in LOOKUP_SLOTS or classify_lookup(s, s.answer) is None
            continue
        values = {" ".join(w[j] for j in LOOKUP_SLOTS[kind] if j < len(w)) for w in objs}
        other = sorted(v for v in values if v != s.answer)
        if not other:  # e.g. both objects are large
            continue
        assert classify_lookup(s, s.answer + ".") == "right"
        assert classify_lookup(s, other[0]) == "other_object"
        assert classify_lookup(s, "zebra") == "absent"
        found += 1
    assert found >= 10


def test_word_geometry_sees_collapsed_shape_words():
    from specula.world.vocab import SHAPES
    from research.probe import word_geometry

    processor = load_processor(TOKENIZER_DIR)
    tok = processor.tokenizer
    model = build_model(TargetArch.from_name("tiny"), tok)
    g = word_geometry(model, tok)
    assert g["shape"]["words"] >= 5 and g["colour"]["words"] >= 6 and g["place"]["words"] == 5
    assert abs(g["shape"]["cosine"]) < 0.5  # random init: nearly orthogonal
    with torch.no_grad():  # collapse the shape words onto one direction (plus a little noise), halve their norm
        w = model.get_input_embeddings().weight
        base = w[5].clone()  # any fixed direction
        for s in SHAPES:
            ids = tok(s, add_special_tokens=False).input_ids
            if len(ids) == 1:
                w[ids[0]] = 0.5 * base + 0.01 * torch.randn_like(base) * base.norm()
    g2 = word_geometry(model, tok)
    assert g2["shape"]["cosine"] > 0.95 and g2["colour"]["cosine"] == g["colour"]["cosine"]


def test_eval_cli_reads_a_training_checkpoint_as_fp16_with_a_code_readout(tmp_path, capsys):
    """``specula zoo eval --checkpoint``: a training run's checkpoint is judged as ``zoo export`` would store it
    (weights rounded to fp16), and ``--codes`` adds the LM's answers on exact word codes."""
    import json

    from safetensors.torch import load_file

    from specula.cli import main
    from specula.training.target.evaluate import load_checkpoint
    from specula.training.target.train import TrainConfig, train

    processor = load_processor(TOKENIZER_DIR)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=0, pool=4, warmup_samples=4,
                             eval_n=1, eval_every_s=1e9, ckpt_every_s=1e9, threads=1, vision_images=4,
                             code_lm_samples=4, code_token_budget=2048), processor, log=lambda m: None)
    model, _, state = load_checkpoint(str(ckpt))
    raw = load_file(ckpt / "model.safetensors")
    got = dict(model.named_parameters())
    name = "model.multi_modal_projector.linear_1.weight"
    assert torch.equal(got[name].detach(), raw[name].half().float()) and not torch.equal(raw[name].half().float(), raw[name])
    assert state["config"]["code_lm_samples"] == 4

    assert main(["zoo", "eval", "--checkpoint", str(ckpt), "--suites", "vqa,video,caption", "--n", "3", "--codes",
                 "--scan-cells", "--json", "--threads", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["suites"]) == {"vqa", "video", "caption", "vqa_codes", "video_codes", "caption_codes",
                                "caption_scan_cells"}
    cells = r["suites"]["caption_scan_cells"]
    assert cells["object"]["cells"] + cells["empty"]["cells"] == 27  # nine per scene
    assert all(cells[k]["cells"] == cells["object"]["cells"] for k in ("size", "colour", "shape"))
    cap = r["suites"]["caption_codes"]  # captions: attribute recall written from exact and from zero codes
    assert set(cap) == {"caption_attribute_recall", "caption_object_precision", "caption_object_recall",
                        "caption_attribute_recall_zero_codes"}
    assert all(0 <= v <= 1 for v in cap.values())
    assert 0 <= r["suites"]["caption"]["caption_object_precision"] <= 1
    assert 0 <= r["suites"]["caption"]["caption_object_recall"] <= 1
    codes = r["suites"]["vqa_codes"]
    assert 0 <= codes["exact"] <= 1 and 0 <= codes["exact_zero_codes"] <= 1
    assert all(0 <= codes[f"tower_{k}"] <= 1 for k in ("colour", "shape", "size", "place"))
    assert sum(t["n"] for t in codes["by_type"].values()) == 3
    video = r["suites"]["video_codes"]  # other suites: the LM on exact codes, by question type, no tower readout
    assert 0 <= video["exact"] <= 1 and "tower_colour" not in video
    assert sum(t["n"] for t in video["by_type"].values()) == 3
    assert set(video["by_type"]) <= {"change", "direction", "end_colour"}
    with pytest.raises(SystemExit, match="unknown"):
        main(["zoo", "eval", "--checkpoint", str(ckpt), "--suites", "vqa,nope"])
    with pytest.raises(SystemExit, match="--checkpoint"):
        main(["zoo", "eval", "--codes"])
    with pytest.raises(FileNotFoundError, match="not a training checkpoint"):
        load_checkpoint(str(tmp_path))


def test_tower_readout_decodes_exact_codes_perfectly(monkeypatch):
    """The decoder of ``tower_readout`` reads every attribute back out of a token that is exactly its patch's code
    (a tower that outputs those codes scores 1.0 everywhere); a random tower does not."""
    import specula.training.target.evaluate as ev
    from specula.training.target.evaluate import tower_readout
    from specula.training.target.word_codes import WordCodes

    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval()
    codes = WordCodes(model.config.text_config.hidden_size, 0)
    random_tower = tower_readout(model, processor, codes, n=5)
    current = {}

    def generate_and_remember(*a, **k):
        current["s"] = s = generate(*a, **k)
        return s

    class ExactCodes(torch.nn.Module):  # in the projector's place: the codes of the image being decoded
        def forward(self, x):
            return codes.images(current["s"].patch_words)  # [1, T, H]

    monkeypatch.setattr(ev, "generate", generate_and_remember)
    monkeypatch.setattr(model.model, "multi_modal_projector", ExactCodes())
    assert tower_readout(model, processor, codes, n=5) == {"colour": 1.0, "shape": 1.0, "size": 1.0, "place": 1.0}
    assert min(random_tower.values()) < 1.0


def test_a_mid_stage_shallow_checkpoint_is_read_through_its_trained_layers_only():
    """A shallow code LM stage trains its first K layers; until it ends the others are untrained (not yet identities),
    so ``--codes`` on a mid-stage checkpoint must answer through the K layers, and through all after the growth."""
    from specula.training.target.evaluate import shallow_layers

    assert shallow_layers({"config": {"code_lm_layers": 2}}) == 2
    assert shallow_layers({"config": {"code_lm_layers": 2}, "code_lm_grown_from": 2}) == 0
    assert shallow_layers({"config": {"code_lm_layers": 0}}) == 0
    assert shallow_layers({"config": {}}) == 0


def test_caption_words_ignore_every_punctuation_mark():
    """A caption names "cross" whether a comma, a full stop or a semicolon follows it (scan captions separate their
    cells with ";": the recall read "cross;" as a word of its own before)."""
    from specula.training.target.quality import caption_words

    words = caption_words("We can see: top left, a large purple cross; top, no object; center, a red star.")
    assert {"cross", "star", "purple", "red", "top", "left"} <= words
    assert not any(set(w) & set(";:,.") for w in words)


def test_attribute_recall_counts_an_attribute_only_when_all_its_words_appear():
    s = [generate("caption", "eval", i) for i in range(3)]
    whole = [" ".join(x.attributes) + "." for x in s]
    assert attribute_recall(s, whole) == 1.0
    assert attribute_recall(s, ["" for _ in s]) == 0.0
    import dataclasses

    two = dataclasses.replace(s[0], attributes=("dark gray", "star"))  # a two-word attribute needs both words
    assert attribute_recall([two], ["a dark star."]) == 0.5
    assert attribute_recall([two], ["a Star; dark, gray"]) == 1.0
    with pytest.raises(ValueError):
        attribute_recall(s, whole[:2])


def test_object_precision_counts_named_objects_that_the_scene_holds():
    """Copies of a named object in empty places leave recall at 1 and pull precision down; both caption forms
    ("a small red circle", "a red circle of large size") are read; samples without (colour, shape) pairs are
    skipped."""
    import dataclasses

    from specula.training.target.quality import object_precision

    s = dataclasses.replace(generate("caption", "eval", 0), attributes=("red", "circle", "blue", "star"))
    right = "top left, a small red circle; top, no object; center, a blue star of large size."
    copies = "top left, a small red circle; top, a small red star; center, a blue star; right, a blue circle."
    assert attribute_recall([s, s], [right, copies]) == 1.0
    assert object_precision([s], [right]) == 1.0
    assert object_precision([s], [copies]) == 0.5  # red star and blue circle are not in the scene
    assert object_precision([s, s], [right, copies]) == pytest.approx(4 / 6)
    assert object_precision([s], ["nothing here."]) == 0.0
    chart = dataclasses.replace(s, attributes=("bars", "apples"))
    assert object_precision([chart], [right]) is None


def test_object_recall_needs_colour_and_shape_named_together_in_any_caption_form():
    """A listing by colour names every colour word, so the gate's word recall is 1 for its colours whatever the
    image; the object recall counts an object only where its colour and shape go together: "a small red circle"
    (free-form and cell scans) or a colour entry's shapes ("red, a small circle ... and a large star")."""
    import dataclasses

    from specula.training.target.quality import named_objects, object_precision, object_recall

    assert named_objects("In the image: red, a small circle at the top and a large star in the center; green, no "
                         "object; blue, a large cross at the left. The green star is above the red circle.") == {
        ("red", "circle"), ("red", "star"), ("blue", "cross"), ("green", "star")}
    assert named_objects("top left, a small red circle; top, no object; center, a blue star of large size.") == {
        ("red", "circle"), ("blue", "star")}
    s = dataclasses.replace(generate("caption", "eval", 0), attributes=("red", "circle", "blue", "star"))
    every_colour = "We can see: red, no object; green, a small circle at the top; blue, no object; white, a large star."
    assert attribute_recall([s], [every_colour]) == 1.0  # every attribute word is there...
    assert object_recall([s], [every_colour]) == 0.0  # ...and no object is named right
    by_colour = "We can see: red, a small circle at the top; green, no object; blue, a large star in the center."
    assert object_recall([s], [by_colour]) == 1.0 and object_precision([s], [by_colour]) == 1.0
    half = "top left, a small red circle; top, a large blue circle."
    assert object_recall([s], [half]) == 0.5 and object_precision([s], [half]) == 0.5
    chart = dataclasses.replace(s, attributes=("bars", "apples"))
    assert object_recall([chart], [half]) is None
    assert object_recall([chart, s], [half, half]) == 0.5  # samples without pairs are skipped


def test_code_answers_match_the_tower_when_the_tower_outputs_exact_codes(monkeypatch):
    """``--codes`` on captions: with the projector replaced by one that outputs the image's exact codes, captions
    written from the tower and from ``code_answers`` are the same; zero codes write something else."""
    from specula.training.target.code_stages import code_answers
    from specula.training.target.quality import greedy_answer
    from specula.training.target.word_codes import WordCodes

    processor = load_processor(TOKENIZER_DIR)
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval()
    marks = [i for t, i in processor.tokenizer.get_vocab().items() if t.startswith("<")]  # eos, role marks, image
    with torch.no_grad():  # a random model that writes words (not marks, not an end at once): text to compare
        model.lm_head.weight[marks] = 0
    codes = WordCodes(model.config.text_config.hidden_size, 0)
    samples = [generate("caption", "eval", i) for i in range(2)]
    current = {}

    class ExactCodes(torch.nn.Module):
        def forward(self, x):
            return codes.images(current["s"].patch_words)  # [1, T, H]

    monkeypatch.setattr(model.model, "multi_modal_projector", ExactCodes())
    tower = []
    for s in samples:
        current["s"] = s
        tower.append(greedy_answer(model, processor, s, 12))
    assert all(tower) and code_answers(model, processor, codes, samples, max_new_tokens=12) == tower
    assert code_answers(model, processor, codes, samples, blank=True, max_new_tokens=12) != tower


def test_scan_cells_reads_every_cell_of_every_scene_once(capsys):
    """``--scan-cells``: nine verdicts per scene, split into cells with and without an object as the reference
    listing has them; a model that only ever says "no" is right on the empty cells and wrong on the others."""
    from specula.cli import main
    from specula.world import scene
    from specula.world.suites import _rng
    from specula.training.target.cell_weights import opener_ids
    from specula.training.target.scan_cells import scan_cells

    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval()
    torch.set_num_threads(1)
    n, offset = 3, 20_000
    empty = sum(scene.make(_rng("caption", "eval", offset + i, 0), "caption", "caption", scan=True).response
                .count("no object") for i in range(n))
    (no_id,) = opener_ids(processor.tokenizer, ("no",))[1]
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-10.0)
        head.bias[no_id] = 10.0
    model.lm_head = head  # a head that says "no" whatever it reads
    r = scan_cells(model, processor, n=n, offset=offset)
    assert r["empty"]["cells"] == empty and r["object"]["cells"] + empty == 9 * n
    assert r["empty"]["argmax_right"] == 1.0 and r["object"]["argmax_right"] == 0.0
    assert r["empty"]["p_mean"] > 0.99 and r["object"]["p_mean"] < 0.01
    for slot in ("size", "colour", "shape"):  # one per object cell: its first object's words
        assert r[slot]["cells"] == r["object"]["cells"] and r[slot]["argmax_right"] == 0.0

    class Copier:  # predicts the token it reads: right only if the verdict were read one place too late
        device, dtype = torch.device("cpu"), torch.float32

        def __call__(self, input_ids, pixel_values):
            import types

            return types.SimpleNamespace(logits=10.0 * torch.nn.functional.one_hot(input_ids, head.out_features).float())

    late = scan_cells(Copier(), processor, n=n, offset=offset)
    assert all(v["argmax_right"] == 0.0 for v in late.values())

    class Prophet(Copier):  # predicts the next token of the reference: right at every place, read where it should be
        def __call__(self, input_ids, pixel_values):
            import types

            nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
            return types.SimpleNamespace(logits=10.0 * torch.nn.functional.one_hot(nxt, head.out_features).float())

    right = scan_cells(Prophet(), processor, n=n, offset=offset)
    assert all(v["argmax_right"] == 1.0 for v in right.values()) and set(right) == set(r)
    with pytest.raises(SystemExit, match="add caption"):
        main(["zoo", "eval", "--model", "target", "--suites", "vqa", "--scan-cells"])
