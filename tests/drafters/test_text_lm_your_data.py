"""``specula train text_lm`` on a user's LLaVA-1.5 / Qwen2.5-VL checkpoint and conversation file (issue 63): the CLI
trains on the file's prompts as the served drafter reads them (the target's chat template, image tokens dropped),
the export loads back as a drafter of that target (its tokenizer, its fingerprint) and keeps greedy output equal to
plain decoding; ``--answers data`` trains on the file's answers; ``--init-lm`` trains an existing causal LM; a bad
file is refused before anything trains, naming the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from specula.cli import main
from specula.drafters import create
from specula.drafters.protocol import DraftContext
from specula.drafters.vocab import VocabMap
from specula.runtime.config_front_door import drafter_from_ref
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.training.data.sources import ConversationSource
from specula.training.drafters.text_lm import Example, fit_vocab, text_view
from specula.zoo.store import weights_fingerprint

MAX_NEW = 8


def train_cli(target_dir, data, tmp: Path, *extra: str) -> tuple[Path, Path]:
    """A few steps of ``specula train text_lm`` through the CLI entry; returns (run dir, export dir)."""
    run, out = tmp / "run", tmp / "export" / "text_lm"
    rc = main(["train", "text_lm", "--target", str(target_dir), "--data", str(data), "--run-dir", str(run),
               "--out", str(out), "--export", "--arch", "tiny", "--samples", "16", "--max-new-tokens", str(MAX_NEW),
               *extra])
    assert rc == 0
    return run, out


def load_drafter(out: Path, target, processor):
    """The export as serving builds it: ``drafter_from_ref`` reads its record, the registry builds the kind."""
    ref = drafter_from_ref(str(out))
    assert ref["kind"] == "text_lm"
    return create({"kind": ref["kind"], **ref["options"]}, target=target, tokenizer=processor)


def file_requests(source: ConversationSource, indices: list[int]):
    params = SamplingParams(max_tokens=MAX_NEW)
    return [source.get("train", i).prompt.request(f"r{i}", params) for i in indices]


@pytest.mark.parametrize("layout", ["llava15_dir", "qwen25vl_dir"])
def test_trains_on_your_target_and_file_and_drafts_losslessly(layout, request, conversations_file, tmp_path):
    target_dir = request.getfixturevalue(layout)
    run, out = train_cli(target_dir, conversations_file, tmp_path)
    processor, target = load_processor(target_dir), load_target(target_dir)
    source = ConversationSource(conversations_file, None, processor, progress=False)
    image_id = target.info.image_token_id

    # the record serving checks: the kind, and the fingerprint of exactly these target weights
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "text_lm" and info["target_sha256"] == weights_fingerprint(target_dir)
    assert info["data_file"] == str(conversations_file) and info["answers"] == "target"
    assert info["data_samples"] == source.size("train")  # the whole file, not the default 30k

    # stage 1 on the file's prompts: the text view of each, the target's own greedy answers (with its images)
    chunk = load_file(run / "data" / "train-00000000.safetensors")
    vision = [i for i in range(5) if source.get("train", i).prompt.pixel_values is not None]
    assert 0 < len(vision) < 5, "the file's first prompts hold image prompts and a text-only one"
    reqs = file_requests(source, list(range(5)))
    plain = SpecEngine(target, None).generate(reqs)
    p0, r0 = 0, 0
    lens = list(zip(chunk["prompt_len"].tolist(), chunk["response_len"].tolist()))
    for i, (lp, lr) in enumerate(lens[:5]):
        sp = source.get("train", i)
        assert torch.equal(chunk["prompt"][p0:p0 + lp].long(), text_view(sp.prompt.input_ids, image_id))
        response = chunk["response"][r0:r0 + lr].long()
        if f"r{i}" in plain:
            assert response.tolist() == plain[f"r{i}"].tokens[:lr]  # what the target answers, images and all
        assert torch.equal(chunk["topk_ids"][r0:r0 + lr, 0].long(), response)  # greedy = its top-1
        p0, r0 = p0 + lp, r0 + lr

    # the served drafter reads exactly the training view of an image prompt
    tok = processor.tokenizer
    img = source.get("train", vision[0]).prompt
    view = text_view(img.input_ids, image_id)
    assert image_id not in view.tolist() and len(view) < len(img.input_ids)
    if layout == "qwen25vl_dir":  # the template's markup around the image stays
        assert "<|vision_start|><|vision_end|>" in tok.decode(view)
    drafter = load_drafter(out, target, processor)
    drafter.begin([DraftContext("probe", img.input_ids, 7)])
    assert drafter._rows["probe"].context[:-1] == view.tolist()

    # the export carries the target's tokenizer, and drafts losslessly on the file's prompts, images included
    saved = PreTrainedTokenizerFast.from_pretrained(out, local_files_only=True)  # as the drafter reads it
    ids = list(range(len(tok)))
    assert len(saved) == len(tok) and saved.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids)
    drafter = load_drafter(out, target, processor)
    got = SpecEngine(target, drafter, gamma=3).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in plain.items()}
    assert sum(r.metrics.blocks for r in got.values()) > 0


def test_answers_data_and_an_existing_lm(qwen25vl_dir, conversations_file, tmp_path):
    """``--answers data``: the file's answers, hard targets (top-1 only, log-prob 0); ``--init-lm``: an existing
    (untied, non-Llama) causal LM over the target's tokenizer is trained and exported as that model type."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    processor, target = load_processor(qwen25vl_dir), load_target(qwen25vl_dir)
    tok = processor.tokenizer
    lm_dir = tmp_path / "small_lm"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=target.info.vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(lm_dir)
    tok.save_pretrained(lm_dir)
    run, out = train_cli(qwen25vl_dir, conversations_file, tmp_path, "--answers", "data", "--init-lm", str(lm_dir))

    source = ConversationSource(conversations_file, None, processor, progress=False)
    chunk = load_file(run / "data" / "train-00000000.safetensors")
    assert chunk["topk_ids"].shape[1] == 1 and not chunk["topk_logp"].any()
    n = int(chunk["response_len"][0])
    assert chunk["response"][:n].long().tolist() == source.get("train", 0).answer_ids[:MAX_NEW].tolist()
    assert json.loads((run / "data" / "meta.json").read_text())["answers"] == "data"

    info = json.loads((out / "specula.json").read_text())
    assert info["answers"] == "data" and info["init_lm"] == str(lm_dir) and info["arch"] is None
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    trained = load_file(out / "model.safetensors")
    assert "lm_head.weight" in trained  # untied: its own head trained and saved
    start = load_file(lm_dir / "model.safetensors")
    assert not torch.equal(trained["lm_head.weight"].float(), start["lm_head.weight"].float())
    drafter = load_drafter(out, target, processor)
    reqs = file_requests(source, [0, 3])
    plain = SpecEngine(target, None).generate(reqs)
    got = SpecEngine(target, drafter, gamma=3).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in plain.items()}


def test_bad_file_fails_before_training_naming_the_record(llava15_dir, conversations_file, tmp_path, capsys):
    lines = conversations_file.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["id"] = "two-marks-one-image"
    bad["conversations"][0]["value"] = "<image>\n<image>\nDescribe both."  # one image file, two marks
    path = conversations_file.parent / "bad.jsonl"
    path.write_text("\n".join([*lines[1:], json.dumps(bad)]) + "\n")
    rc = main(["train", "text_lm", "--target", str(llava15_dir), "--data", str(path), "--run-dir",
               str(tmp_path / "run"), "--arch", "tiny", "--samples", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and "id 'two-marks-one-image'" in err and "2 <image> markers but 1 image" in err
    assert not (tmp_path / "run" / "data").exists()  # nothing asked of the target, nothing trained


def test_fit_vocab_follows_the_served_drafters_vocabulary():
    """A drafter LM that lacks target ids (>= shared): fed as its substitute, never a training target."""
    vocab = VocabMap(width=10, rows=8, shared=8, substitute=0)
    e = Example(torch.tensor([1, 9, 2]), torch.tensor([3, 4, 8, 5]), torch.tensor([[3, 9], [4, 1], [8, 2], [5, 1]]),
                torch.log(torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.5, 0.5]])))
    f = fit_vocab(e, vocab)
    assert f.prompt.tolist() == [1, 0, 2] and f.response.tolist() == [3, 4]  # cut before id 8
    assert f.topk_ids.tolist() == [[3, 0], [4, 1]] and f.topk_logp[0, 1] == float("-inf")
    assert torch.allclose(f.topk_logp[0].softmax(-1), torch.tensor([1.0, 0.0]))  # no teacher mass past shared
    same = Example(torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([[3, 4]]), torch.zeros(1, 2))
    assert fit_vocab(same, vocab) is same
