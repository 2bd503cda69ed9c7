"""Lane snapshots: a checkpoint kept as an int8 delta against its base comes back within the recorded error."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from research.cli import main
from specula.training.target.evaluate import load_checkpoint
from research.lanes import DELTA_FILE, INFO_FILE, INT8_TOL, SCALE_SUFFIX, dequantize, pack, quantize, restore, save
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import _load_init_weights


def test_quantize_keeps_each_row_within_half_a_step_of_its_scale():
    torch.manual_seed(0)
    d = torch.randn(6, 5, 3) * torch.tensor([1e-4, 1e-2, 1.0, 0.0, 3.0, 1e-3])[:, None, None]
    q, scale = quantize(d)
    assert q.dtype == torch.int8 and scale.shape == (6,) and scale.dtype == torch.float16
    err = (dequantize(q, scale) - d).abs().reshape(6, -1).amax(-1)
    assert bool((err <= scale.float() * 0.5 + 1e-3 * d.abs().reshape(6, -1).amax(-1)).all())
    assert float(dequantize(q, scale)[3].abs().max()) == 0.0  # a row that did not move stays exactly put


@pytest.fixture()
def lane(processor, tmp_path):
    """A tiny exported base and a training checkpoint whose LM moved and whose tower did not."""
    torch.manual_seed(0)
    base = build_model(TargetArch.from_name("tiny"), processor.tokenizer)
    base.to(torch.float16).save_pretrained(tmp_path / "base")
    processor.save_pretrained(tmp_path / "base")
    base = base.float()
    moved = {k: v.clone() for k, v in base.state_dict().items()}
    for k, v in moved.items():
        if "language_model" in k:
            v += 0.01 * torch.randn_like(v)
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in moved.items() if k != "lm_head.weight"}, str(ckpt / "model.safetensors"))
    state = {"samples": 1234, "elapsed_s": 600.0, "history": [{"samples": 1000, "vqa_exact": 0.5}],
             "config": {"arch": "tiny", "number_images": True, "set_hops": "reader"}}
    (ckpt / "state.json").write_text(json.dumps(state))
    return tmp_path, ckpt


def test_a_tensor_with_rewritten_rows_is_kept_in_fp16_and_a_drifted_one_in_int8():
    g = torch.Generator().manual_seed(0)
    drift = torch.randn(16, 32, generator=g) * 1e-3  # what training moves a weight by
    packed, err = pack(drift)
    assert packed[""].dtype == torch.int8 and SCALE_SUFFIX in packed and err <= INT8_TOL
    rewritten = drift.clone()
    rewritten[3] = torch.randn(32, generator=g) * 10  # a row written outright (the count key fit)
    packed, err = pack(rewritten)
    assert set(packed) == {""} and packed[""].dtype == torch.float16
    assert err == float((packed[""].float() - rewritten).abs().max()) and err < 1e-2
    assert float((dequantize(*quantize(rewritten)) - rewritten).abs().max()) > INT8_TOL  # what int8 would have cost
    bias = torch.randn(8, generator=g)
    assert pack(bias)[0][""].dtype == torch.float16


def test_a_snapshot_stores_what_moved_and_comes_back_within_its_error(lane, tmp_path):
    root, ckpt = lane
    info = save(ckpt, root / "base", root / "snap", note="the lane's command")
    assert info["state"]["samples"] == 1234 and info["note"] == "the lane's command"
    stored = load_file(str(root / "snap" / DELTA_FILE))
    assert stored and all("language_model" in k for k in stored)  # the tower and projector did not move
    assert info["tensors_same"] > 0 and 0 < info["max_abs_error"] < 1e-3
    out = restore(root / "snap", root / "back")
    want, _, _ = load_checkpoint(str(ckpt))
    got, processor, state = load_checkpoint(str(out))
    assert state["samples"] == 1234 and processor.number_images
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        err = float((a - b).abs().max())
        # compared after both sides' fp16 rounding: within the int8 error plus one fp16 step of the weight
        assert err <= info["max_abs_error"] + float(a.abs().max()) * 2 ** -10, k
        if "language_model" not in k and k != "lm_head.weight":  # the head is tied to the LM's embedding
            assert err == 0.0, k
    fresh = build_model(TargetArch.from_name("tiny"), processor.tokenizer)
    facts = _load_init_weights(fresh, out)  # what `specula train target --init-from` reads
    assert facts["trained_samples"] == 1234 and facts["history"][0]["vqa_exact"] == 0.5


def test_a_restore_refuses_other_base_weights_and_an_existing_checkpoint(lane, tmp_path):
    root, ckpt = lane
    save(ckpt, root / "base", root / "snap")
    restore(root / "snap", root / "back")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        restore(root / "snap", root / "back")
    w = load_file(str(root / "base" / "model.safetensors"))
    name = next(iter(w))
    w[name] = w[name] + 1
    save_file(w, str(root / "base" / "model.safetensors"))
    with pytest.raises(ValueError, match="not the ones"):
        restore(root / "snap", root / "back2")
    assert main(["lane", "restore", "--snapshot", str(root / "nothing"), "--out", str(root / "x")]) == 2


def test_the_command_saves_and_restores(lane, capsys):
    root, ckpt = lane
    assert main(["lane", "save", "--ckpt", str(ckpt), "--base", str(root / "base"), "--out",
                 str(root / "snap"), "--note", "cmd"]) == 0
    assert json.loads((root / "snap" / INFO_FILE).read_text())["note"] == "cmd"
    assert main(["lane", "restore", "--snapshot", str(root / "snap"), "--out", str(root / "back")]) == 0
    assert (root / "back" / "model.safetensors").exists() and "--init-from" in capsys.readouterr().out
