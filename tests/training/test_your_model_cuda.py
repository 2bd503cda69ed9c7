"""On a machine with a CUDA device (skipped elsewhere: CI has none; ``bash .ci/device_check.sh`` runs it): a drafter
trained for a user's checkpoint on the GPU, from the user's conversation file, then served by the in-process app
(the same ingress, vision and verifier engines as Ray Serve's replicas) on the GPU, greedy output equal to plain
decoding's. Issue 63, deliverable 7."""

from __future__ import annotations

import base64
import io

import pytest
import torch

DEVICE = "cuda"  # the check itself runs anywhere: set SPECULA_YOUR_MODEL_DEVICE=cpu to try it without a GPU
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "SPECULA_YOUR_MODEL_DEVICE") != "cpu", reason="no CUDA device")


def _chat(app, image_png: bytes | None) -> str:
    content = [{"type": "text", "text": "Describe the image."}]
    if image_png is not None:
        url = "data:image/png;base64," + base64.b64encode(image_png).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, *content]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0}
    return app.openai("chat", body)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("layout", ["llava15_dir", "qwen25vl_dir"])
def test_a_drafter_trained_on_cuda_for_your_checkpoint_serves_like_plain_decoding(layout, request, tmp_path,
                                                                                conversations_file):
    from PIL import Image

    from specula.cli import main
    from specula.runtime.config import load_config
    from specula.runtime.config_front_door import apply_flags
    from specula.runtime.serve.local import LocalApp

    import os

    device = os.environ.get("SPECULA_YOUR_MODEL_DEVICE", DEVICE)
    model_dir = request.getfixturevalue(layout)
    out = tmp_path / "eagle"
    rc = main(["train", "eagle", "--target", str(model_dir), "--data", str(conversations_file), "--run-dir",
               str(tmp_path / "run"), "--out", str(out), "--export", "--device", device, "--samples", "64",
               "--data-samples", "64", "--max-new-tokens", "12"])
    assert rc == 0 and (out / "specula.json").exists()
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 30)).save(buf, format="PNG")
    answers = {}
    for name, drafter, gamma in (("spec", str(out), 4), ("plain", "ngram", 0)):
        cfg = apply_flags({}, str(model_dir), drafter, gamma)
        for d in ("vision_encoder", "drafter_ensemble", "target_verifier"):
            cfg.setdefault("deployments", {})[d] = {"device": device} if device == "cpu" else {
                "device": device, "ray_actor_options": {"num_gpus": 1}}
        app = LocalApp.from_config(load_config(cfg))
        answers[name] = (_chat(app, buf.getvalue()), _chat(app, None))
    assert answers["spec"] == answers["plain"]
