"""Helpers of the serving tests (world prompts as engine requests or HTTP bodies, test configs)."""

from __future__ import annotations

import base64
import io

from specula.runtime.config import load_config
from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.bench.report.reliability import record_figure  # noqa: F401 (re-exported for the serving tests)
from specula.runtime.core.sampling import SamplingParams
from specula.world import generate
from specula.world.tokenizer import format_turns

SUITES = ["vqa", "caption", "text", "multi_image", "chart", "reasoning"]


def world_requests(processor, n: int, params: SamplingParams, start: int = 0,
                   suites: list[str] | None = None) -> list[GenerationRequest]:
    """World prompts (images included) as the engine tests build them, round robin over ``suites``."""
    out = []
    suites = suites or SUITES
    for i in range(start, start + n):
        s = generate(suites[i % len(suites)], "eval", i)
        text = format_turns(s.prompt)
        if s.images:
            enc = processor(text=[text], images=list(s.images), return_tensors="pt", add_special_tokens=False)
            pix = enc["pixel_values"]
        else:
            enc, pix = processor.tokenizer([text], return_tensors="pt", add_special_tokens=False), None
        out.append(GenerationRequest(f"r{i}", enc["input_ids"][0], pix, params))
    return out


def world_body(i: int, max_tokens: int = 16) -> dict:
    """A POST /generate body from world sample i: its prompt and its images as base64 PNG."""
    s = generate(SUITES[i % len(SUITES)], "eval", i)
    images = []
    for im in s.images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode())
    return {"prompt": s.prompt, "images": images, "max_tokens": max_tokens}


_separate = {"vision_encoder": {"colocate": False}, "target_verifier": {"in_ingress": False}}


def make_config(model_dir, drafter: dict | None = None, **sections):
    """A config for tests: the temp model, one torch thread and no reserved CPUs per replica; the public gRPC API
    on a free port (not the default 50051, which another process may hold); the drafter in its own DrafterEnsemble
    (these tests are about the distributed data plane; ``drafter={"colocate": True}`` puts it in the verifier); the
    images encoded by the VisionEncoder deployment (``vision_encoder.colocate: false``); the verifier in its own
    TargetVerifier deployment (``target_verifier.in_ingress: false``)."""
    dep = {"num_replicas": 1, "torch_threads": 1, "ray_actor_options": {"num_cpus": 0}}
    raw = {
        "model": {"path": str(model_dir)},
        "grpc": {"port": 0},
        "drafter": {"kind": "ngram", "options": {"max_n": 3}, "gamma": 4, "colocate": False, **(drafter or {})},
        "deployments": {name: dict(dep, **_separate.get(name, {})) for name in
                        ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier")},
        **sections,
    }
    return load_config(raw)
