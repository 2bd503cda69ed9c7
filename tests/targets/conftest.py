"""Tiny random LLaVA and Qwen2.5-VL targets (fp32, CPU) and prompt builders for the target tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specula.targets import PrefillRequest, load_target

from tiny_targets import LLAVA_IMAGE, QWEN_END, QWEN_IMAGE, QWEN_START, QWEN_VIDEO, tiny_llava, tiny_qwen  # noqa: F401


@dataclass
class Kit:
    """One backend: the stock model, a prompt maker and a full-recompute reference."""

    name: str
    model: torch.nn.Module

    def target(self, **kw):
        return load_target(self.model, device="cpu", **kw)

    def request(self, rid: str, text_lens: list[int], sizes: list[int], seed: int) -> PrefillRequest:
        """A prompt of text runs with one image between consecutive runs; ``sizes`` picks each image's shape
        (LLaVA: ignored, every image is 28x28; Qwen: image i is 16 px high and 16 or 24 px wide)."""
        g = torch.Generator().manual_seed(seed)
        pieces, images, grids = [], [], []
        for i, n in enumerate(text_lens):
            pieces.append(torch.randint(3, 90, (n,), generator=g))
            if i < len(sizes):
                if self.name == "llava":
                    pieces.append(torch.full((4,), LLAVA_IMAGE))
                    images.append(torch.randn(1, 3, 28, 28, generator=g))
                else:
                    w = 4 if sizes[i] == 0 else 6
                    pieces.append(torch.tensor([QWEN_START] + [QWEN_IMAGE] * w + [QWEN_END]))
                    images.append(torch.randn(4 * w, 3 * 2 * 4 * 4, generator=g))
                    grids.append([1, 4, w])
        ids = torch.cat(pieces)
        if not images:
            return PrefillRequest(rid, ids)
        pixels = torch.cat(images)
        grid = torch.tensor(grids) if grids else None
        return PrefillRequest(rid, ids, pixel_values=pixels, image_grid_thw=grid)

    @torch.no_grad()
    def recompute(self, req: PrefillRequest, sequence: list[int], hidden_layers=None):
        """Stock full forward of ``sequence`` (prompt + continuation) with the request's images."""
        ids = torch.tensor(sequence)[None]
        kw = {}
        if req.pixel_values is not None:
            kw["pixel_values"] = req.pixel_values
        if self.name == "qwen2_5_vl":
            self.model.model.rope_deltas = None
            kw["mm_token_type_ids"] = (ids == QWEN_IMAGE).int()
            if req.image_grid_thw is not None:
                kw["image_grid_thw"] = req.image_grid_thw
        if hidden_layers is not None:
            kw["output_hidden_states"] = True
        return self.model(input_ids=ids, use_cache=True, **kw)


_MODELS = {}


def _kit(name: str) -> Kit:
    if name not in _MODELS:
        _MODELS[name] = tiny_llava() if name == "llava" else tiny_qwen()
    return Kit(name, _MODELS[name])


@pytest.fixture(params=["llava", "qwen2_5_vl"])
def kit(request) -> Kit:
    return _kit(request.param)


@pytest.fixture
def llava_kit() -> Kit:
    return _kit("llava")


@pytest.fixture
def qwen_kit() -> Kit:
    return _kit("qwen2_5_vl")


