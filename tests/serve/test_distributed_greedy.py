"""Greedy output of the distributed runtime equals plain decoding, for every shipped drafter on the shipped target.

The reference is the committed text of plain decoding (tests/data/reference_greedy.json, ``specula bench
reference``), not another speculative run, so two runtimes agreeing on a wrong answer still fail here. One config
serves every shipped drafter kind side by side (``drafter.alternatives``; a request picks one by its ``drafter``
field): ngram, text_lm, eagle, msd, flash, aasd, massv and the IbED family on the massv weights (ensemble, pooled,
caption), each as a chain and, where the kind builds one, as a tree (all but ngram, flash and aasd), with
overlap on, ``predraft`` 3 and offers on. The same config runs through three doors:

- real Ray Serve (four deployments, a local 2-CPU Ray), HTTP ``POST /generate``;
- the same application's public gRPC API (a real grpcio client to the Ingress replica);
- the gRPC data plane alone: ``LocalApp`` (ingress, vision, verifier in this process, the drafter in a
  DrafterServer over loopback gRPC), no Ray.

Through each door every drafter answers some of the reference prompts one at a time (batch 1) and more of them all
at once, every drafter's requests together (they share the verifier's batch and the drafter replica's batcher).
Every answer must be the reference's tokens, drafted by the drafter it chose (``metrics.drafter``, never a
fallback). So that none passes on rejections alone (a drafter whose drafts are all rejected returns plain decoding's
tokens too), each drafter must, per door, have at least ``MIN_ACCEPTED`` draft tokens accepted and some rejected;
and over each door the drafting ahead must really have happened: blocks drafted ahead used (``spec_used``), used
for a rejection outcome (predraft: ``spec_branch``) and taken as Offers (``offers_taken``). Those data-plane counters
are not part of any API's answer, so the verifier engine here is the shipped one with its last chunk's counters
copied into ``metrics.time_s`` (``counting_verifier.py``, injected with ``build_app(engine_classes=...)``), which
both doors carry unchanged.
"""

from __future__ import annotations

import base64
import io
import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from specula.drafters.protocol import supports_lockstep, supports_lookahead, supports_predraft
from specula.runtime.bench import reference as ref
from specula.runtime.serve import LocalApp

import counting_verifier
from counting_verifier import CountingVerifierEngine
from ray_kit import free_port, post, run_app, serve_session
from serve_kit import make_config

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray's own pydantic use

GAMMA = 4
# name -> (kind, options): every shipped drafter kind, as a chain and as a tree where the kind builds one (the bench
# report's rule: flash and aasd refuse trees, ngram builds a chain whatever it is told)
DRAFTERS = {
    "ngram": ("ngram", {"max_n": 3}),
    "text_lm": ("text_lm", {}), "text_lm_tree": ("text_lm", {"structure": "tree"}),
    "eagle": ("eagle", {}), "eagle_tree": ("eagle", {"structure": "tree"}),
    "msd": ("msd", {}), "msd_tree": ("msd", {"structure": "tree"}),
    "flash": ("flash", {}),
    "aasd": ("aasd", {}),
    "massv": ("massv", {}), "massv_tree": ("massv", {"structure": "tree"}),
    "ensemble": ("ensemble", {"join": "at_once"}),  # every member from the start: the mixture over the wire
    "ensemble_tree": ("ensemble", {"structure": "tree", "join": "at_once"}),
    "pooled": ("pooled", {}), "pooled_tree": ("pooled", {"structure": "tree"}),
    "caption": ("caption", {}), "caption_tree": ("caption", {"structure": "tree"}),
}
ONE_AT_A_TIME = 2  # reference prompts per drafter and door sent alone
TOGETHER = 4  # and sent at once with every other drafter's (68 requests through CONCURRENCY clients at a time)
CONCURRENCY = 8
MIN_ACCEPTED = 20  # draft tokens accepted per drafter and door, at least (measured: 31 for ngram, 69-108 the others)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def doc():
    return ref.load()


def _config(http_port: int = 0):
    default, *rest = DRAFTERS
    # deadlines far above any step on a busy machine: a fallback here would be a slow machine, not the drafter
    drafter = {"kind": DRAFTERS[default][0], "options": DRAFTERS[default][1], "gamma": GAMMA, "overlap": True,
               "predraft": 3, "offers": True, "propose_timeout_s": 120.0, "connect_timeout_s": 60.0,
               "alternatives": {n: {"kind": DRAFTERS[n][0], "options": DRAFTERS[n][1]} for n in rest}}
    return make_config("target", drafter=drafter, http={"host": "127.0.0.1", "port": http_port})


@pytest.fixture
def local():
    """The gRPC data plane alone: LocalApp with the counting verifier (no Ray)."""
    app = counting_verifier.local_app(_config())
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="module")
def served():
    """One real Ray Serve application with every drafter; (config, HTTP base URL, gRPC address)."""
    pytest.importorskip("ray")
    from ray import serve

    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = _config(port)
    # the counting engine travels by value (tests/ is not on the replicas' import path)
    with serve_session(port, by_value=(counting_verifier,)) as url:
        run_app(build_app(cfg, engine_classes={"target_verifier": CountingVerifierEngine}), cfg.name, timeout=300)
        address = serve.get_deployment_handle("Ingress", app_name=cfg.name).grpc_address.remote().result(timeout_s=60)
        yield cfg, url, address


# ------------------------------------------------------------------------------------------------ requests


def _images(entry: dict) -> list[bytes]:
    out = []
    for im in ref.sample_prompt(entry["suite"], entry["index"], entry["seed"]).images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _body(entry: dict, name: str, max_tokens: int) -> dict:
    return {"prompt": entry["prompt"], "images": [base64.b64encode(b).decode() for b in _images(entry)],
            "max_tokens": max_tokens, "temperature": 0.0, "drafter": name}


def _plan(doc) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(drafter, reference entry) pairs sent one at a time, and those sent together. Mostly the long answers (23-32
    tokens: caption, reasoning, text), where drafts are decided many times; every drafter also gets one short
    answer (1-3 tokens, multi-image and video prompts among them) in the concurrent set."""
    long = [e for e in doc["prompts"] if len(e["tokens"]) > 10]
    short = [e for e in doc["prompts"] if len(e["tokens"]) <= 10]
    alone, together = [], []
    for j, name in enumerate(DRAFTERS):
        picks = [long[(2 * j + i) % len(long)] for i in range(ONE_AT_A_TIME + TOGETHER - 1)]
        alone += [(name, e) for e in picks[:ONE_AT_A_TIME]]
        together += [(name, e) for e in picks[ONE_AT_A_TIME:]] + [(name, short[j % len(short)])]
    return alone, together


def _via_http(url: str):
    def send(name: str, entry: dict, max_tokens: int) -> dict:
        status, raw = post(f"{url}/generate", _body(entry, name, max_tokens), timeout=600)
        assert status == 200, raw[:500]
        return json.loads(raw)
    return send


def _via_grpc(address: str):
    from specula.runtime.api_client import SpeculaClient

    client = SpeculaClient(address, timeout=600)

    def send(name: str, entry: dict, max_tokens: int) -> dict:
        r = client.generate(entry["prompt"], _images(entry), max_tokens=max_tokens, temperature=0.0, drafter=name)
        return {"tokens": r.tokens, "text": r.text, "metrics": r.metrics, "drafter": r.drafter}
    return send, client


def _via_local(app: LocalApp):
    def send(name: str, entry: dict, max_tokens: int) -> dict:
        return app.generate(_body(entry, name, max_tokens))
    return send


def _check_door(door: str, send, doc, tokenizer=None) -> dict:
    """Every planned request through ``send``: each equals the reference; per drafter acceptance and rejection
    minima; over the door, drafting ahead used, predraft used, offers taken. Returns the figures."""
    max_tokens = doc["header"]["max_new_tokens"]
    alone, together = _plan(doc)
    results = [send(n, e, max_tokens) for n, e in alone]
    with ThreadPoolExecutor(CONCURRENCY) as pool:  # at once: the verifier batches them, drafters mixed
        results += list(pool.map(lambda job: send(*job, max_tokens), together))
    per = defaultdict(lambda: defaultdict(float))
    for (name, e), got in zip(alone + together, results):
        assert got["tokens"] == e["tokens"], (door, name, e["id"], got.get("text"), e["text"])
        assert got["drafter"] == "ok", (door, name, e["id"], got["drafter"])
        m = got["metrics"]
        assert m["drafter"] == name, (door, name, m["drafter"])  # the replica's own word on who drafted
        per[name]["requests"] += 1
        per[name]["drafted"] += m["draft_tokens"]
        per[name]["accepted"] += m["accepted_tokens"]
        for k, v in counting_verifier.counters(m).items():
            per[name][k] += v
    for name, f in per.items():
        print(f"{door} {name}: " + ", ".join(f"{k} {int(v)}" for k, v in f.items()))
    for name, f in per.items():
        assert f["accepted"] >= MIN_ACCEPTED, (door, name, dict(f))
        assert f["drafted"] > f["accepted"], (door, name, "no draft was rejected", dict(f))
    ahead = [n for n in DRAFTERS if _capable(n)[0]]
    assert all(per[n]["overlap"] == per[n]["requests"] for n in ahead), {n: dict(per[n]) for n in ahead}
    total = {k: sum(per[n][k] for n in ahead) for k in ("spec_used", "spec_branch", "offers_taken")}
    print(f"{door} drafting ahead over {ahead}: {total}")
    assert total["spec_used"] > 0 and total["offers_taken"] > 0, (door, total)
    assert sum(per[n]["spec_branch"] for n in DRAFTERS if _capable(n)[1]) > 0, (door, total)
    return per


_CAPABLE: dict[str, tuple[bool, bool]] = {}


def _capable(name: str) -> tuple[bool, bool]:
    """(drafts ahead, predrafts) for a drafter of DRAFTERS: what overlap and predraft apply to."""
    if not _CAPABLE:
        from specula.runtime.engine.factory import make_drafter

        multi = make_drafter(_config())
        for n, d in multi.drafters.items():
            _CAPABLE[n] = (supports_lookahead(d), supports_predraft(d))
    return _CAPABLE[name]


# ------------------------------------------------------------------------------------------------ tests


def test_the_config_serves_every_shipped_drafter_chain_and_tree():
    from specula.runtime.bench.report.drafters import TEST_ONLY
    from specula.drafters.registry import kinds

    assert {k for k, _ in DRAFTERS.values()} == set(kinds()) - set(TEST_ONLY)
    from specula.runtime.engine.factory import make_drafter

    multi = make_drafter(_config())
    structures = {n: d.spec.structure for n, d in multi.drafters.items()}
    assert structures == {n: "tree" if n.endswith("_tree") else "chain" for n in DRAFTERS}
    assert _capable("text_lm") == (True, True) and _capable("eagle") == (True, True)
    # some of them grow their predraft branches in lockstep and some cannot: the MultiDrafter as a whole does not,
    # but keeps ``grow`` for the batcher to route the sessions whose own drafter does (it once lost it, and every
    # text_lm / eagle / msd session through it failed over to decoding alone)
    assert not supports_lockstep(multi) and callable(multi.grow)
    assert supports_lockstep(multi.drafters["text_lm"]) and not supports_lockstep(multi.drafters["ngram"])


def test_the_data_plane_alone_gives_plain_decoding(local, doc):
    _check_door("local", _via_local(local), doc)


def test_ray_serve_http_gives_plain_decoding(served, doc):
    _, url, _ = served
    _check_door("http", _via_http(url), doc)


def test_ray_serve_grpc_gives_plain_decoding(served, doc):
    _, _, address = served
    send, client = _via_grpc(address)
    with client:
        _check_door("grpc", send, doc)
