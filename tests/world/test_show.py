import json

from specula.cli import main


def test_world_sample_writes_pngs_and_text(tmp_path):
    assert main(["world", "sample", "--suite", "vqa", "--suite", "multi_image", "--n", "2", "--out", str(tmp_path)]) == 0
    recs = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 4
    for r in recs:
        assert r["images"] and all((tmp_path / f).is_file() for f in r["images"])
    assert "## vqa" in (tmp_path / "README.md").read_text()
