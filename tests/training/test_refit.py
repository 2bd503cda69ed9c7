"""``specula zoo refit-projector``: the projector fitted again onto codes with one code per layout cell; the tokens
change only along the cell codes, and the checkpoint resumes as before."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specula.targets.processor import load_processor
from specula.world.vocab import POSITIONS
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.refit import refit_projector
from specula.training.target.train import TrainConfig, train
from specula.training.target.word_codes import WordCodes, cell_word

BASE = dict(arch="tiny", pool=8, token_budget=2048, warmup_samples=4, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9,
            threads=1, code_lm_samples=8, code_lm_layers=1, code_token_budget=2048, vision_images=8,
            projector_fit_images=8)


def test_each_cell_gets_a_code_of_its_own():
    """"bottom left" and "bottom" share code(bottom) in the summed code; the cell word tells them apart, and only
    object patches with a place get one."""
    assert cell_word(("red", "circle", "small", "bottom", "left")) == "<cell bottom left>"
    assert cell_word(("red", "circle", "small", "bottom")) == "<cell bottom>"
    assert cell_word(("red", "circle", "small", "center")) == "<cell center>"
    assert cell_word(("stop",)) is None and cell_word(()) is None
    assert len({cell_word(("x", *name.split())) for name in POSITIONS.values()}) == 9
    plain, celled = WordCodes(64, 0), WordCodes(64, 0, cell_codes=0.5)
    words = ("red", "circle", "small", "bottom", "left")
    torch.testing.assert_close(celled.patch(words) - plain.patch(words), 0.5 * plain.code("<cell bottom left>"))
    assert torch.equal(celled.patch(("stop",)), plain.patch(("stop",))) and not celled.patch(()).any()


@pytest.mark.slow
def test_refit_moves_the_tokens_only_along_the_cell_codes(tmp_path):
    from specula.cli import main
    from specula.training.target.evaluate import load_checkpoint
    from specula.training.target.projector_fit import _features
    from specula.world.suites import generate

    processor = load_processor(TOKENIZER_DIR)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "a"), total_samples=8, seed=0, **BASE), processor,
                 log=lambda m: None)
    plain, celled = tmp_path / "plain" / "ckpt", tmp_path / "celled" / "ckpt"
    assert main(["zoo", "refit-projector", "--ckpt", str(ckpt), "--out", str(plain), "--cell-codes", "0",
                 "--images", "16", "--no-gate"]) == 0
    refit_projector(ckpt, celled, 2.0, images=16, gate=False, log=lambda m: None)
    a, b, before = (load_file(p / "model.safetensors") for p in (plain, celled, ckpt))
    changed = {k for k in b if not torch.equal(b[k], before[k])}
    assert changed and all(k.startswith("model.multi_modal_projector.") for k in changed)
    assert {p.name for p in ckpt.iterdir()} == {p.name for p in celled.iterdir()}  # optimizers and heads come along
    state = json.loads((celled / "state.json").read_text())
    assert state["projector_refits"][-1]["cell_codes"] == 2.0 and state["samples"] == 8

    # the refitted tokens are the plain refit's plus a part in the span of the nine cell codes (the ridge fit is
    # one regression per output direction), up to the GELU identity's tolerance and the fp16 rounding of the export
    m_plain, _, _ = load_checkpoint(str(plain))
    m_cell, _, _ = load_checkpoint(str(celled))
    from specula.training.target.batching import Encoder

    pix = torch.cat([Encoder(processor).encode(generate("caption", "eval", i)).pixel_values for i in range(2)])
    with torch.no_grad():
        x = _features(m_plain, pix)  # [2, T, D]
        diff = m_cell.model.multi_modal_projector(x) - m_plain.model.multi_modal_projector(x)  # [2, T, H]
    width = diff.shape[-1]
    cells = torch.stack([WordCodes(width, 0).code(f"<cell {n}>") for n in POSITIONS.values()])  # [9, H]
    q, _ = torch.linalg.qr(cells.T)  # [H, 9]
    outside = diff - (diff @ q) @ q.T
    assert diff.norm() > 1.0 and outside.norm() < 0.1 * diff.norm()
    with pytest.raises(FileExistsError):
        refit_projector(ckpt, celled, 1.0, images=16)
    with pytest.raises(ValueError, match="cell_codes"):
        refit_projector(ckpt, tmp_path / "neg" / "ckpt", -1.0, images=16)
