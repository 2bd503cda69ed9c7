"""`specula bench target` on a small LLaVA saved to disk: JSON + markdown with the ratios asked for."""

import json

from transformers import AutoTokenizer

from specula.cli import main
from specula.targets.processor import build_processor
from specula.zoo.paths import TOKENIZER_DIR
from specula.zoo.target_config import TargetArch, build_model


def test_bench_target_writes_json_and_markdown(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model_dir = tmp_path / "tiny"
    build_model(TargetArch.from_name("tiny"), tok).save_pretrained(model_dir)
    build_processor(tok).save_pretrained(model_dir)
    out = tmp_path / "bench"
    rc = main(["bench", "target", "--model", str(model_dir), "--out", str(out), "--max-gamma", "3", "--repeats", "2",
               "--threads", "1"])
    assert rc == 0
    r = json.loads((out / "bench_target.json").read_text())
    text = json.dumps(r)
    for key in ("decode", "verify", "prefill"):
        assert key in text
    assert r["machine"]["torch_threads"] == 1
    assert (out / "bench_target.md").read_text().strip()
