"""``python -m research probe-sets``: hop masses from exact attention maps, answers scored, the command's output."""

import json

import pytest
import torch

from research.cli import main
from specula.world import generate
from specula.world.vocab import COLOUR_NAMES, NUMBER_WORDS, ORDINALS
from specula.training.target.referents import ReferentTarget
from research.set_probe import PROBE_OFFSET, SetLayout, candidates, pick, probe_sets, read_hops
from specula.targets.embedded_arch import TargetArch, build_model


def _attn(layers: int, heads: int, length: int, rows: dict) -> list[torch.Tensor]:
    """Attention maps that are zero but for ``rows``: (layer, head, query) -> {key: weight}."""
    maps = [torch.zeros(heads, length, length) for _ in range(layers)]
    for (layer, head, query), keys in rows.items():
        for key, w in keys.items():
            maps[layer][head, query, key] = w
    return maps


def test_each_hop_is_read_on_its_own_layer_and_head_on_and_off_its_target():
    layout = SetLayout(objects=((2, 3), (6, 7), (10, 11)), summaries=(5, 9, 13))
    targets = (
        ReferentTarget(20, (6, 7), (15,), patch_layer=1, word_layer=0, group="set", head=0, word_head=4),
        ReferentTarget(20, (2, 3, 6, 7, 10, 11), (), patch_layer=1, group="set_odd", head=3, spread=True),
        ReferentTarget(20, (10, 11), (), patch_layer=2, group="set_odd", head=0),
        ReferentTarget(5, (2, 3), (), patch_layer=0, group="set_count", head=3),
        ReferentTarget(9, (6, 7), (), patch_layer=0, group="set_count", head=3),
        ReferentTarget(20, (0, 5, 13), (15,), patch_layer=1, group="set_count", head=2, spread=True, word_head=0),
    )
    maps = _attn(3, 5, 21, {
        (1, 0, 20): {6: 0.3, 7: 0.3, 2: 0.1, 12: 0.3},  # reader: 0.6 named, 0.1 on another image, 0.3 on text
        (0, 4, 20): {15: 0.9},  # the ordinal hop
        (1, 3, 20): {2: 0.2, 11: 0.2, 12: 0.6},  # the mean hop: 0.4 on objects
        (2, 0, 20): {10: 0.25, 11: 0.25, 3: 0.25},  # the odd hop: 0.5 on the odd image, 0.75 on objects
        (0, 3, 5): {2: 1.0}, (0, 3, 9): {6: 0.5},  # the summary hops: 1.0 and 0.5
        (1, 2, 20): {0: 0.4, 5: 0.2, 9: 0.3, 13: 0.1},  # the count hop: first 0.4, matching 0.3, other 0.3
        (0, 0, 20): {15: 0.7},  # the count hop's word hop
    })
    # the maps of layers 1 and 2 share keys with other heads that must not leak into a hop's reading
    maps[1][1, 20, 6] = 0.9
    got = read_hops(maps, targets, layout)  # the count target names images 0 and 2 (summaries 5 and 13)
    expect = {"reader_named": 0.6, "reader_other": 0.1, "ordinal_hop": 0.9, "mean_hop_objects": 0.4,
              "odd_hop_odd": 0.5, "odd_hop_objects": 0.75, "summary_hop": 0.75, "count_matching": 0.3,
              "count_other": 0.3, "count_matching_each": 0.15, "count_other_each": 0.3, "odd_share": 2 / 3, "count_word_hop": 0.7,
              "odd_share_even": 1 / 3}
    assert set(got) == set(expect) | {"count_first"}
    for key, v in expect.items():
        assert got[key] == pytest.approx(v), key
    assert got["count_first"][0] == 2 and got["count_first"][1] == pytest.approx(0.4)


def test_candidates_are_the_words_each_question_type_can_be_answered_with():
    seen = {}
    for i in range(60):
        s = generate("multi_image", "eval", PROBE_OFFSET + i)
        seen.setdefault(s.kind.split("/")[-1], s)
    assert candidates(seen["which"]) == COLOUR_NAMES
    assert candidates(seen["odd"]) == ORDINALS[:len(seen["odd"].images)]
    assert candidates(seen["count"]) == NUMBER_WORDS[:len(seen["count"].images) + 1]
    for s in seen.values():
        if s.kind != "multi_caption":
            assert s.answer in candidates(s)
    logits = torch.zeros(10)
    logits[7], logits[3] = 2.0, 5.0
    assert pick(logits, [7, 3, 1]) == 1


@pytest.fixture(scope="module")
def tiny(processor):
    torch.manual_seed(0)
    processor.number_images = True
    yield build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval(), processor
    processor.number_images = False


def test_a_probe_of_a_model_reports_every_question_type_with_readings_in_range(tiny):
    model, processor = tiny
    n = 24
    r = probe_sets(model, processor, n=n, set_hops="shallow", progress=False)
    asked = [generate("multi_image", "eval", PROBE_OFFSET + i).kind.split("/")[-1] for i in range(n)]
    for kind in ("which", "odd", "count"):
        assert r[kind]["questions"] == asked.count(kind)
        assert sum(r[kind]["answers"].values()) == asked.count(kind)
        for key, v in r[kind].items():
            if isinstance(v, float):
                assert 0.0 <= v <= 1.0 + 1e-6, (kind, key)
    assert r["which"]["reader_named"] + r["which"]["reader_other"] <= 1.0 + 1e-6
    assert r["odd"]["odd_hop_odd"] <= r["odd"]["odd_hop_objects"] + 1e-6
    assert r["count"]["count_first_by_m"] and "summary_hop" in r["count"]


def test_the_command_writes_json_and_markdown(tiny, tmp_path, capsys):
    model, processor = tiny
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    code = main(["probe-sets", "--model", str(tmp_path / "m"), "--set-hops", "shallow", "--n", "6",
                 "--threads", "1", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "probe_sets.json").read_text())
    assert report["n"] == 6 and report["set_hops"] == "shallow" and report["model"] == str(tmp_path / "m")
    assert (tmp_path / "out" / "probe_sets.md").read_text().startswith("| question |")
    assert "| question |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--n must be > 0"):
        main(["probe-sets", "--model", str(tmp_path / "m"), "--n", "0"])
    # the reader hops' ordinal sits on head 4, which this 4-head LM does not have: refused, not an IndexError
    with pytest.raises(SystemExit, match=r"the ordinal hop \(layer 0, head 4; --set-hops reader\) .*4 heads"):
        main(["probe-sets", "--model", str(tmp_path / "m"), "--set-hops", "reader", "--n", "2",
              "--threads", "1"])
