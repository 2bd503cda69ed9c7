"""``drafter.text_only``: requests without images that name no drafter draft with that drafter, in the verifier
(drafter colocated) and over the data plane (a DrafterServer); requests with images, and requests naming a drafter,
keep theirs. Answers equal plain decoding token for token either way, and the metrics name the drafter that drafted.
The rule itself (``runtime/engine/drafter_route.py``) and the config's checks and default come first."""

from __future__ import annotations

import pytest
import torch

from serve_kit import make_config, world_body
from specula.runtime.config import ConfigError, load_config
from specula.runtime.engine.drafter_route import has_images, route
from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.runtime.serve import LocalApp
from specula.targets import load_target

SHORT = {"short": {"kind": "ngram", "options": {"max_n": 2}}}


def test_the_rule_routes_only_unnamed_requests_without_images():
    ids = torch.tensor([1, 2, 3])
    text = GenerationRequest("t", ids)
    image = GenerationRequest("i", ids, pixel_values=torch.zeros(1, 3, 4, 4))
    features = GenerationRequest("v", ids, visual=torch.zeros(1, 2, 8))
    named = GenerationRequest("n", ids, drafter="eagle")
    assert not has_images(text) and has_images(image) and has_images(features)
    assert route(text, "short").drafter == "short" and route(text, None).drafter is None
    assert route(image, "short").drafter is None and route(features, "short").drafter is None
    assert route(named, "short").drafter == "eagle"


def test_the_config_checks_the_name_and_the_embedded_target_routes_text_to_msd(model_dir):
    with pytest.raises(ConfigError, match="text_only: 'short' is not a drafter served here"):
        load_config({"model": {"path": str(model_dir)}, "drafter": {"kind": "ngram", "text_only": "short"}})
    cfg = load_config({"model": {"path": str(model_dir)}, "drafter": {"kind": "ngram", "alternatives": SHORT,
                                                                      "text_only": "short"}})
    assert cfg.drafter.text_only == "short"
    # the embedded target's default: flash, and msd (trained for it too) for text-only requests
    d = load_config({}).drafter
    assert d.kind == "flash" and d.text_only == "msd" and set(d.alternatives) == {"msd"}
    assert load_config({"drafter": {"text_only": None}}).drafter.text_only is None  # the user's null stays
    assert load_config({"drafter": {"kind": "flash"}}).drafter.text_only is None  # a kind chosen: no route added
    # a model the shipped drafters were not trained for: ngram alone
    d = load_config({"model": {"path": str(model_dir)}}).drafter
    assert d.kind == "ngram" and d.text_only is None and not d.alternatives


@pytest.mark.parametrize("colocate", [True, False])
def test_text_requests_draft_with_the_text_drafter_and_answer_as_plain_decoding(model_dir, colocate):
    cfg = make_config(model_dir, drafter={"colocate": colocate, "adaptive": False, "alternatives": SHORT,
                                          "text_only": "short"})
    target = load_target(model_dir)
    text = {"prompt": "Describe a red square on a blue background in many words.", "max_tokens": 24}
    samples = [world_body(i, max_tokens=24) for i in range(4)]  # world suites with images and without
    bodies = [(text, "short"), ({**text, "drafter": "ngram"}, "ngram"),
              *((b, "ngram" if b["images"] else "short") for b in samples)]
    assert {w for _, w in bodies[2:]} == {"ngram", "short"}
    with LocalApp.from_config(cfg) as a:
        for body, want in bodies:
            got = a.generate(body)
            req = a.ingress.prepare(a.ingress.parse(body), "ref")
            assert got["tokens"] == SpecEngine(target, None, gamma=0).generate([req])["ref"].tokens, body["prompt"]
            assert got["metrics"]["drafter"] == want and got["drafter"] == "ok", (body["prompt"], got["metrics"])
            assert got["metrics"]["blocks"] > 0


def test_bench_served_in_process_default_routes_as_the_served_verifier(model_dir, monkeypatch):
    """``bench served``'s in-process default builds the same MultiDrafter and routes text prompts the same way."""
    from specula.drafters.multi_drafter import MultiDrafter
    from specula.runtime.bench.served import in_process_runners, world_prompts
    from specula.targets.processor import load_processor

    began = []
    real_begin = MultiDrafter.begin
    monkeypatch.setattr(MultiDrafter, "begin",
                        lambda self, cs: (began.extend(self.resolve(c.drafter) for c in cs), real_begin(self, cs))[1])
    target, processor = load_target(model_dir), load_processor(model_dir)
    runners = in_process_runners(target, processor, {"kind": "ngram", "max_n": 3}, 4, 24,
                                 alternatives={"short": {"kind": "ngram", "max_n": 2}}, text_only="short",
                                 default_name="ngram")
    prompts = world_prompts(processor, ["text", "caption"], 1)
    assert [p.encoded.pixel_values is None for p in prompts] == [True, False]
    for p in prompts:
        got, want = runners["default"]([p])[0], runners["plain"]([p])[0]
        assert got["text"] == want["text"] and got["tokens"] > 2
    assert began == ["short", "ngram"]
