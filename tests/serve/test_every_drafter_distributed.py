"""Every registered drafter kind through the distributed runtime, unchanged: LocalApp (ingress, VisionEngine,
VerifierEngine, and the drafter in a DrafterServer on loopback gRPC, overlap on) gives plain decoding's tokens
for greedy requests, with the drafter really drafting (``drafter == "ok"``, never a fallback) and, for an image
prompt, getting the target features its spec names; a sampled request completes, and with overlap off a seed
repeats it exactly.

Weights are tiny and made here, once: one target (the tiny LLaVA with larger LM weights, so greedy answers vary);
random heads for eagle / msd / flash / aasd (they rarely draft the target's token: equality under rejection);
and the target's own LM as text_lm and as the massv model of massv / caption / pooled / ensemble (its projector is
the target's), so their drafts are accepted and accepted blocks go through the data plane too. A kind registered
without an entry in ``OPTIONS`` fails ``test_every_registered_kind_is_covered`` (and its own parametrized tests).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict

import pytest
import torch

from specula.drafters.protocol import supports_lookahead
from specula.drafters.registry import kinds
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.verifier import VerifierEngine
from specula.targets import load_target

from serve_kit import make_config, world_body

IMAGE, TEXT = 5, 2  # world samples: a one-image reasoning prompt (its answer repeats prompt tokens: ngram drafts),
                    # and a text-only prompt
MAX_TOKENS = 12
GAMMA = 3
COPIES = {"text_lm", "massv", "caption", "pooled", "ensemble"}  # drafters holding the target's own LM

# kind -> its config options, given the weights' directory (only JSON-able values: what a YAML file would hold)
OPTIONS = {
    "ngram": lambda w: {"max_n": 3},
    "random": lambda w: {"seed": 0},
    "text_lm": lambda w: {"path": str(w / "text_lm")},
    "eagle": lambda w: {"path": str(w / "eagle")},
    "msd": lambda w: {"path": str(w / "msd")},
    "flash": lambda w: {"path": str(w / "flash")},
    "aasd": lambda w: {"path": str(w / "aasd")},
    "massv": lambda w: {"path": str(w / "massv")},
    "caption": lambda w: {"path": str(w / "massv")},  # the massv model captions the images itself
    "pooled": lambda w: {"path": str(w / "massv"), "grid": 3},
    "ensemble": lambda w: {"path": str(w / "massv"), "join": "at_once"},  # all four members from the start
}


def test_every_registered_kind_is_covered():
    assert sorted(OPTIONS) == kinds(), "a drafter kind is registered without a distributed equality test here"


# ------------------------------------------------------------------------------------------------ weights


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The target checkpoint and every trained kind's weights, in one temp dir."""
    from transformers import LlamaForCausalLM

    from specula.drafters.aasd_head import AasdConfig, AasdHead
    from specula.drafters.eagle_head import EagleConfig, EagleHead, save_head
    from specula.drafters.flash_head import FlashConfig, FlashHead
    from specula.drafters.massv_model import MassvConfig, MassvModel
    from specula.drafters.msd_head import MsdConfig, MsdHead
    from specula.targets.processor import load_processor
    from specula.world.tokenizer import format_turns
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    root = tmp_path_factory.mktemp("every_drafter")
    processor = load_processor(TOKENIZER_DIR)
    tok = processor.tokenizer
    model = build_model(TargetArch.from_name("tiny"), tok, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the init: greedy answers vary instead of repeating one token
        for p in model.model.language_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    model.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")

    lm = LlamaForCausalLM(model.config.text_config)  # the target's LM: exact drafts on text-only prompts
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.tie_weights()
    lm.eval().save_pretrained(root / "text_lm")

    base = EagleConfig.from_target(model)
    heads = {"eagle": EagleHead(base), "msd": MsdHead(MsdConfig(**asdict(base))),
             "flash": FlashHead(FlashConfig.from_target(model, tokens_per_pass=3, visual_tokens=8)),
             "aasd": AasdHead(AasdConfig.from_target(model, kv_tokens=8))}
    for kind, head in heads.items():
        with torch.no_grad():  # seeded, large enough for context-dependent q; aasd's KV pooling stays an average
            for name, p in head.named_parameters():
                if p.dim() == 2 and not name.startswith("w_"):
                    p.normal_(0, 0.1, generator=g)
        save_head(head, root / kind)
        (root / kind / "specula.json").write_text(json.dumps({"kind": kind, "target": str(root / "target")}))

    # the massv model: the target's LM and projector over its pre-projector features, with a caption prompt
    image = model.config.image_token_id
    prompt = tuple(tok(format_turns("<image>Describe the image in detail."), add_special_tokens=False).input_ids)
    massv = MassvModel(lm, MassvConfig(feature_dim=model.config.vision_config.hidden_size, image_token_id=image,
                                       caption_prompt=prompt, caption_max_tokens=6, eos_token_id=tok.eos_token_id))
    proj = model.model.multi_modal_projector
    massv.projector[0].load_state_dict(proj.linear_1.state_dict())
    massv.projector[2].load_state_dict(proj.linear_2.state_dict())
    massv.eval().save(root / "massv")
    return root


@pytest.fixture(scope="module")
def plain(weights):
    """Plain target decoding of the two prompts, in one process (the target reads the pixels itself)."""
    ingress = IngressEngine.from_config(make_config(weights / "target"))  # the app's chat template and tokens
    reqs = {i: ingress.prepare(ingress.parse(world_body(i, MAX_TOKENS)), f"plain{i}")
            for i in (IMAGE, TEXT)}
    eng = SpecEngine(load_target(weights / "target"), None)
    return {i: eng.generate([r])[r.request_id] for i, r in reqs.items()}


def _config(weights, kind: str, overlap: bool = True):
    if kind not in OPTIONS:
        pytest.fail(f"drafter kind {kind!r} has no entry in OPTIONS: add weights and options for it")
    # deadlines far above any step on a busy machine: a fallback here would be a slow machine, not the drafter
    drafter = {"kind": kind, "options": OPTIONS[kind](weights), "gamma": GAMMA, "overlap": overlap,
               "propose_timeout_s": 120.0, "connect_timeout_s": 60.0}
    return make_config(weights / "target", drafter=drafter)


@pytest.fixture(scope="module", params=kinds())
def deployed(request, weights):
    """LocalApp with this kind's drafter (overlap on); the contexts its drafter's ``begin`` received."""
    kind = request.param
    app = LocalApp.from_config(_config(weights, kind))
    drafter = app.drafter.drafter
    seen = []
    real_begin = drafter.begin

    def begin(contexts):  # the real begin, recording what came over the wire
        seen.extend(contexts)
        return real_begin(contexts)

    drafter.begin = begin
    try:
        yield kind, app, seen
    finally:
        app.close()


def _answer(app: LocalApp, body: dict) -> tuple[dict, dict]:
    """The POST /generate JSON, and the verifier's last chunk (with its data-plane figures)."""
    req = app.ingress.prepare(app.ingress.parse(body), uuid.uuid4().hex)
    resp = app.ingress.response(req)
    last = None
    for chunk in app.run(req):
        resp.add(chunk)
        last = chunk
    return resp.result(), last


# ------------------------------------------------------------------------------------------------ tests


def test_greedy_equals_plain_decoding(deployed, plain):
    kind, app, seen = deployed
    spec = app.drafter.drafter.spec
    image_id = app.ingress.tokenizer.convert_tokens_to_ids(app.ingress.image_token)
    drafted = 0
    for i in (IMAGE, TEXT):
        seen.clear()
        got, last = _answer(app, world_body(i, MAX_TOKENS))
        want = plain[i]
        assert got["tokens"] == want.tokens, (kind, i)
        assert got["finish_reason"] == want.finish_reason
        assert got["drafter"] == "ok", (kind, i, got["drafter"])
        dp, m = last["dataplane"], got["metrics"]
        assert dp["proposals"] >= 1 and m["blocks"] >= 1, (kind, i, dp, m)
        assert dp["overlap"] == supports_lookahead(app.drafter.drafter)
        drafted += m["draft_tokens"]
        if kind in COPIES and (i == TEXT or kind == "massv"):  # the target's own LM drafts: its drafts hold
            assert m["accepted_tokens"] >= MAX_TOKENS // 2, (kind, i, m)

        (ctx,) = seen
        n_image = int((ctx.prompt_ids == image_id).sum())
        assert n_image == (144 if i == IMAGE else 0)
        _check_features(spec.needs, ctx, n_image)
    assert drafted > 0, f"{kind} proposed no draft token at all"


def _check_features(needs: frozenset[str], ctx, n_image: int) -> None:
    """What Begin carried: each needed feature, shaped for this prompt; nothing else."""
    L = len(ctx.prompt_ids)
    if "hidden" in needs:
        assert ctx.hidden is not None and ctx.hidden.shape[0] == L
    else:
        assert ctx.hidden is None
    if "last_kv" in needs:
        assert ctx.extra["last_k"].shape[1] == L and ctx.extra["last_v"].shape == ctx.extra["last_k"].shape
    else:
        assert "last_k" not in ctx.extra and "last_v" not in ctx.extra
    for name, got in (("visual", ctx.visual), ("pre_projector", ctx.extra.get("pre_projector")),
                      ("pixels", ctx.pixel_values)):
        if name in needs and n_image:
            assert got is not None, f"{name} is needed and did not reach the drafter"
            if name != "pixels":
                assert got.ndim == 3 and got.shape[0] * got.shape[1] == n_image, (name, tuple(got.shape))
        else:
            assert got is None, f"{name} was sent to a drafter that does not read it"


def test_sampled_runs_complete_and_a_seed_repeats_them(deployed, weights):
    kind, app, _ = deployed
    body = {**world_body(IMAGE, MAX_TOKENS), "temperature": 1.0, "seed": 11}
    got = app.generate(body)  # overlap on: lossless, but how far drafting ahead got (and so the drafter's
    # randomness used) depends on timing: runs may differ
    assert got["drafter"] == "ok" and got["finish_reason"] in ("length", "eos")
    assert 1 <= len(got["tokens"]) <= MAX_TOKENS

    verifier = VerifierEngine.from_config(_config(weights, kind, overlap=False))  # the session asks not to
    try:
        serial = LocalApp(app.ingress, app.vision, verifier, app.drafter)  # draft ahead
        runs = [_answer(serial, body) for _ in range(2)]
    finally:
        verifier.close()
    assert runs[0][0]["tokens"] == runs[1][0]["tokens"], kind
    for got, last in runs:
        assert got["drafter"] == "ok" and last["dataplane"]["overlap"] is False


@pytest.mark.parametrize("from_vision", [True, False])
def test_pre_projector_features_come_from_the_vision_stage(weights, plain, from_vision):
    """massv's pre-projector features: computed by the VisionEncoder's engine (the verifier never runs the tower
    for them), or, with ``vision_encoder.pre_projector: false``, by the verifier from the pixels; either way the
    drafter gets the target's own features and the output is plain decoding's."""
    cfg = _config(weights, "massv")
    raw = cfg.model_dump()
    raw["deployments"]["vision_encoder"]["pre_projector"] = from_vision
    from specula.runtime.config import load_config

    app = LocalApp.from_config(load_config(raw))
    try:
        asked = []
        target = app.verifier.target
        real_encode = target.encode_images

        def encode_images(pixels, variant="projected", **kw):
            asked.append(variant)
            return real_encode(pixels, variant, **kw)

        target.encode_images = encode_images
        drafter, seen = app.drafter.drafter, []
        real_begin = drafter.begin
        drafter.begin = lambda contexts: (seen.extend(contexts), real_begin(contexts))[1]
        got, _ = _answer(app, world_body(IMAGE, MAX_TOKENS))
        assert got["tokens"] == plain[IMAGE].tokens and got["drafter"] == "ok"
        assert ("pre_projector" in asked) is (not from_vision), asked
        (ctx,) = seen
        ingress_req = app.ingress.prepare(app.ingress.parse(world_body(IMAGE, MAX_TOKENS)), "ref")
        want = real_encode(ingress_req.pixel_values, "pre_projector").features
        assert torch.allclose(ctx.extra["pre_projector"].float(), want.float(), atol=1e-5)
    finally:
        app.close()


def test_ensemble_members_join_on_demand_across_the_data_plane(weights, plain):
    """The ensemble's default, members joining on demand, in a DrafterServer with overlap on (blocks drafted ahead,
    verdicts observed ahead): its first member (the image pooled to one token, so it misses) drafts alone until its
    first miss, then the multimodal member joins mid-answer; greedy output equals plain decoding and a sampled run
    completes, the drafter never falling back."""
    opts = {"path": str(weights / "massv"), "members": [{"kind": "pooled", "grid": 1}, "multimodal"],
            "join_after": 1, "join_below": 1.0, "join_greedy": True}
    drafter = {"kind": "ensemble", "options": opts, "gamma": GAMMA, "overlap": True, "propose_timeout_s": 120.0,
               "connect_timeout_s": 60.0}
    app = LocalApp.from_config(make_config(weights / "target", drafter=drafter))
    try:
        d = app.drafter.drafter
        joined: list[str] = []
        real = d._join_due

        def watched(seen):
            waiting = set(d._waiting)
            real(seen)
            joined.extend(sorted(waiting - set(d._waiting)))  # only a join takes a request off the waiting list here

        d._join_due = watched
        got, last = _answer(app, world_body(IMAGE, MAX_TOKENS))
        assert got["tokens"] == plain[IMAGE].tokens and got["drafter"] == "ok"
        assert last["dataplane"]["overlap"] is True and len(joined) == 1, joined
        sampled = app.generate({**world_body(IMAGE, MAX_TOKENS), "temperature": 1.0, "seed": 11})
        assert sampled["drafter"] == "ok" and 1 <= len(sampled["tokens"]) <= MAX_TOKENS
        deadline = time.monotonic() + 30  # a session ends when its stream closes, on the server's own thread
        while (d._rows or d._waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not d._rows and not d._waiting  # every session's rows released
    finally:
        app.close()
