"""``specula bench spec --prompts FILE`` on the stock LLaVA-1.5 and Qwen2.5-VL layouts: the report's rows are the
file's prompts (a prompts JSONL or a LLaVA-Instruct / ShareGPT4V conversation file, told apart by content), each
rendered by the checkpoint's own chat template and processor, speculative greedy output equal to plain decoding's;
``--no-hf`` loads nothing HF-side but the target (``from_pretrained`` of the checkpoint's HF class is called once);
a bad record is one error naming it, before any model loads. Real models, real files."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from transformers import LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

from specula.cli import main

LAYOUTS = [("llava15_dir", LlavaForConditionalGeneration), ("qwen25vl_dir", Qwen2_5_VLForConditionalGeneration)]
RUN = ["--drafter", "ngram", "--max-tokens", "6", "--threads", "1"]


def _png(path: Path, rgb, size=(40, 32)) -> str:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path)
    return path.name


def _prompts_file(folder: Path) -> tuple[Path, list[dict]]:
    """A prompts JSONL with images under ``folder``/pics: one image, two images placed by marks (own suite label),
    text only with a system message."""
    _png(folder / "pics" / "a.png", (220, 30, 30))
    _png(folder / "pics" / "b.png", (30, 60, 220), (48, 40))
    records = [{"id": "one-image", "prompt": "What colour is the picture?", "images": ["pics/a.png"]},
               {"id": "two-images", "prompt": "Compare <image> with <image>.", "images": ["pics/a.png", "pics/b.png"],
                "suite": "compare"},
               {"id": 7, "prompt": "Name three primes.", "system": "Answer briefly."}]
    f = folder / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f, records


def _bench(args: list[str], hf_class) -> tuple[int, dict, str, int]:
    """``specula bench spec`` in this process; (exit status, bench_spec.json, bench_spec.md, from_pretrained calls)."""
    out = Path(args[args.index("--out") + 1])
    with mock.patch.object(hf_class, "from_pretrained", wraps=hf_class.from_pretrained) as spy:
        rc = main(["bench", "spec", *args])
    return rc, json.loads((out / "bench_spec.json").read_text()), (out / "bench_spec.md").read_text(), spy.call_count


@pytest.mark.parametrize("layout, hf_class", LAYOUTS, ids=["llava15", "qwen25vl"])
def test_prompts_file_rows_are_its_prompts_greedy_equal_to_plain_with_no_hf(layout, hf_class, request, tmp_path):
    from specula.runtime.engine.prompts import encode_prompt
    from specula.targets.processor import load_processor
    from PIL import Image

    model = request.getfixturevalue(layout)
    f, records = _prompts_file(tmp_path)
    rc, r, md, loads = _bench(["--model", str(model), "--prompts", str(f), "--n", "2", "--no-hf",
                               "--out", str(tmp_path / "out"), *RUN], hf_class)
    assert rc == 0
    assert loads == 1  # the target itself; no second HF copy under --no-hf
    assert r["loaded"] == {"target": r["loaded"]["target"], "hf_baseline": None} and "hf" not in r["configs"]
    assert [p["id"] for p in r["prompts"]] == ["one-image", "two-images", "7"]  # only the file's: no world suite
    assert r["suites"] == ["prompts", "compare"] and r["config"]["suites"] == []
    assert [p["images"] for p in r["prompts"]] == [1, 2, 0]
    assert all(p["exact"] == {"ngram@5": True} and p["plain_tokens"] > 0 for p in r["prompts"])
    assert r["configs"]["ngram@5"]["greedy_exact"] is True
    # rendered by the checkpoint's own template and processor: the same tokens encode_prompt gives
    processor = load_processor(model)
    two = records[1]
    images = [Image.open(tmp_path / p).convert("RGB") for p in two["images"]]
    assert r["prompts"][1]["prompt_tokens"] == encode_prompt(processor, two["prompt"], images).input_ids.numel()
    text = encode_prompt(processor, records[2]["prompt"], system=records[2]["system"])
    assert r["prompts"][2]["prompt_tokens"] == text.input_ids.numel()
    assert "## prompts" in md and all(f"| {i} |" in md for i in ("one-image", "two-images", "7"))


@pytest.mark.parametrize("layout, hf_class", LAYOUTS, ids=["llava15", "qwen25vl"])
def test_conversation_file_exchanges_beside_a_world_suite_with_hf(layout, hf_class, request, conversations_file,
                                                                  tmp_path):
    model = request.getfixturevalue(layout)
    rc, r, _, loads = _bench(["--model", str(model), "--prompts", str(conversations_file), "--suite", "caption",
                              "--n", "4", "--out", str(tmp_path / "out"), *RUN], hf_class)
    assert rc == 0
    assert loads == 2 and r["loaded"]["hf_baseline"] == hf_class.__name__  # the HF baseline's own copy
    ids = [p["id"] for p in r["prompts"]]
    # the world suite's prompts, then the file's first 4 exchanges: r2 has two images and a second, answered turn
    assert ids == [f"caption-{i}" for i in range(4)] + ["r0/0", "r1/0", "r2/0", "r2/1"]
    assert [p["images"] for p in r["prompts"][4:]] == [1, 1, 2, 2]
    assert r["prompts"][7]["prompt_tokens"] > r["prompts"][6]["prompt_tokens"]  # the earlier exchange is in it
    assert r["suites"] == ["caption", "prompts"] and r["configs"]["ngram@5"]["greedy_exact"] is True
    assert r["configs"]["hf"]["suites"]["prompts"]["tokens"] > 0


@pytest.mark.parametrize("kind", ["prompts", "conversations"])
def test_a_missing_image_is_an_error_naming_the_record(kind, tmp_path, capsys):
    _png(tmp_path / "pics" / "a.png", (220, 30, 30))
    if kind == "prompts":
        rows = [{"id": "fine", "prompt": "Describe.", "images": ["a.png"]},
                {"id": "broken", "prompt": "Describe.", "images": ["missing.png"]}]
    else:
        rows = [{"id": "fine", "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nHi"},
                                                                  {"from": "gpt", "value": "Hello."}]},
                {"id": "broken", "image": "missing.png", "conversations": [
                    {"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello."}]}]
    f = tmp_path / "file.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # no model is loaded: the file is checked first (a model that does not exist would be the next error)
    rc = main(["bench", "spec", "--model", str(tmp_path / "no-model"), "--prompts", str(f), "--image-root",
               str(tmp_path / "pics"), "--no-hf", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "record 1 (line 2), id 'broken'" in err and "missing.png" in err
    assert str(tmp_path / "pics" / "missing.png") in err and "'fine'" not in err
    assert f"1 bad record(s) in {f} (nothing was measured" in err


def test_bad_prompt_records_are_named_each(tmp_path, capsys):
    _png(tmp_path / "a.png", (1, 2, 3))
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "Fine.", "images": ["a.png"]}\n'
                 '{"id": "m", "prompt": "<image> and <image>?", "images": ["a.png"]}\n'
                 '{"id": "b", "prompt": "hi", "imgs": ["a.png"]}\n[1, 2]\n{"id": "a", "prompt": "again"}\n')
    rc = main(["bench", "spec", "--prompts", str(f), "--no-hf"])
    err = capsys.readouterr().err
    assert rc == 2 and f"4 bad record(s) in {f}" in err
    assert "record 1 (line 2), id 'm': the prompt has 2 '<image>' marks for 1 images" in err
    assert "record 2 (line 3), id 'b': unknown key(s) imgs" in err
    assert "record 3 (line 4): is not a JSON object" in err
    assert "record 4 (line 5), id 'a': the id is also" in err and "record 0 (line 1), id 'a'" in err


def test_a_drafter_dir_trained_for_other_weights_is_refused_naming_both(qwen25vl_dir, tmp_path, capsys):
    from specula.zoo.store import weights_fingerprint

    other = tmp_path / "eagle-for-another"
    other.mkdir()
    (other / "specula.json").write_text(json.dumps({"kind": "eagle", "target_sha256": "e" * 64}))
    f, _ = _prompts_file(tmp_path)
    rc = main(["bench", "spec", "--model", str(qwen25vl_dir), "--prompts", str(f), "--drafter", str(other),
               "--no-hf", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "eeeeeeeeeeeeeeee" in err and weights_fingerprint(qwen25vl_dir)[:16] in err and str(other) in err
    assert not (tmp_path / "out").exists()  # refused before anything ran
