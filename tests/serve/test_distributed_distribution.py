"""Sampled output of the distributed runtime follows the shipped target's law: the end-to-end distribution check
(``tests/runtime/distribution_check.py``, docs/design.md "End-to-end distribution check") through real Ray Serve's
HTTP door and through the gRPC data plane alone (LocalApp: ingress, vision, verifier here, the drafter in a
DrafterServer over loopback gRPC), with the model drafters flash and massv, overlap on, predraft 3, offers on.

The target is the shipped one, T = 1, top_k = 4, on the reference's "tiny story" prompt (text-50005: 64 cells, 22
of them expected >= 5 at n = 1024 (df 22 with the pooled rest), none above 0.29, no EOS among them, so every
request emits k = 3 tokens; the image prompts have a few cells holding most of the mass, and cost 3x as much). Each
request is one OpenAI chat completion (``top_k`` is an extension field there; ``POST /generate`` has no top_k) with
max_tokens 3 and its own seed; the API answers text, and the 64 cells decode to 64 different texts, so the text
names the cell (a text that is none of them fails the test). Token 2 is the first draft's verdict; token 3 is the
bonus when it was accepted, or after a rejection comes from the next block: for massv (which drafts ahead) a block
drafted for that rejection outcome (predraft), so the overlap's blocks decide it; ``counting_verifier.py`` shows
that they did (``spec_branch`` > 0 over each massv run). Such a block is asked for, not taken as an Offer, here:
offers_taken measured 0 (an Offer goes out once its block is whole, and a one-draft verify is back before that);
test_distributed_greedy.py sees Offers taken.

Every correct run must accept and reject at least n / 10 first drafts and keep p > 1e-4. The same check must
reject a faulted verifier through the same path: ``accept_every_draft_p_allows`` (``distribution_faults.py``)
patched into LocalApp's in-process verifier (a patch cannot reach Ray's replica processes), massv drafting. There
it measured D = 0.35 at n = 1024 (statistic 380, df 22, p 7e-67): about noncentral chi-square(22, 357), mean 379, sd
38, against a 1e-6 critical value of 69. flash's first drafts never meet 0 < q < p here (its q sits below the
truncated p on the support; the same fault left its counts unchanged), so its runs check the recovered tokens and
massv's check both. n = 1024 per run, 16 requests in flight at a time: 30-40 s per run on 2 busy cores, 3.5 min for
the file with Ray's start. Measured on correct runs: p 0.26-0.68, first drafts accepted 127-153 (flash) and 407-427
(massv) of 1024.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the shared check

import distribution_faults as faults  # noqa: E402
from distribution_check import chi2_test, exact_law  # noqa: E402

from specula.runtime.bench import reference as ref  # noqa: E402
from specula.runtime.core.sampling import SamplingParams  # noqa: E402
from specula.runtime.serve.ingress import IngressEngine  # noqa: E402
from specula.runtime.serve.openai_api import OpenAIApi  # noqa: E402
from specula.zoo.store import resolve  # noqa: E402

import counting_verifier  # noqa: E402
from counting_verifier import CountingVerifierEngine  # noqa: E402
from ray_kit import free_port, post, run_app, serve_session  # noqa: E402
from serve_kit import make_config  # noqa: E402

pytestmark = [pytest.mark.statistical, pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray's own pydantic use

K = 3
PARAMS = SamplingParams(temperature=1.0, top_k=4)
PROMPT = "text-50005"
N = 1024  # requests per run
CONCURRENCY = 16  # requests in flight at a time
ALPHA, FAULT_P = 1e-4, 1e-6
GAMMA = 2  # max_tokens 3 caps the first block at one draft anyway
DRAFTERS = ("flash", "massv")


def _config(http_port: int = 0):
    # deadlines far above any step on a busy machine: a fallback here would be a slow machine, not the drafter
    drafter = {"kind": "flash", "options": {}, "gamma": GAMMA, "overlap": True, "predraft": 3, "offers": True,
               "propose_timeout_s": 120.0, "connect_timeout_s": 60.0, "alternatives": {"massv": {"kind": "massv"}}}
    return make_config("target", drafter=drafter, http={"host": "127.0.0.1", "port": http_port})


def _body(name: str, seed: int) -> dict:
    entry = next(e for e in ref.load()["prompts"] if e["id"] == PROMPT)
    assert entry["images"] == 0, "this body carries no images"
    return {"messages": [{"role": "user", "content": entry["prompt"]}], "max_tokens": K, "seed": seed,
            "temperature": PARAMS.temperature, "top_k": PARAMS.top_k, "drafter": name}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def law():
    """The exact law of the first K tokens of the prompt the server prepares from the body, and text -> cell."""
    ingress = IngressEngine.from_config(_config())
    api = OpenAIApi(ingress)
    base = api.prepare(api.parse("chat", _body("flash", 0)), "law")
    law = exact_law(resolve("target"), base, PARAMS, K)
    tok = ingress.tokenizer
    assert not bool((law.cells == tok.eos_token_id).any()), "EOS in the support: a request could stop early"
    cell_of_text = {tok.decode(c.tolist(), skip_special_tokens=True): c for c in law.cells}
    assert len(cell_of_text) == len(law.cells), "two cells decode to the same text: the answer cannot name its cell"
    return law, cell_of_text


@pytest.fixture(scope="module")
def local():
    app = counting_verifier.local_app(_config())
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="module")
def served():
    """One real Ray Serve application (flash by default, massv by name); the HTTP base URL."""
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = _config(port)
    with serve_session(port, by_value=(counting_verifier,)) as url:  # tests/ is not on the replicas' path
        run_app(build_app(cfg, engine_classes={"target_verifier": CountingVerifierEngine}), cfg.name, timeout=300)
        yield url


def _sample(chat, law, name: str, seed0: int, n: int = N):
    """n chat completions (seeds seed0 ..) through ``chat``; the chi-square outcome, first drafts accepted and
    rejected, and the data-plane counters summed."""
    _, cell_of_text = law
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda i: chat(_body(name, seed0 + i)), range(n)))
    rows, accepted, rejected = [], 0, 0
    dp = dict.fromkeys(counting_verifier.COUNTERS, 0.0)
    for a in answers:
        text, ext = a["choices"][0]["message"]["content"], a["specula"]
        assert ext["drafter"] == "ok" and ext["metrics"]["drafter"] == name, ext
        assert text in cell_of_text, f"{text!r} is none of the support's texts"
        rows.append(cell_of_text[text])
        m = ext["metrics"]
        if m["drafted_at"]:
            accepted += m["accepted_at"][0]
            rejected += m["drafted_at"][0] - m["accepted_at"][0]
        for k, v in counting_verifier.counters(m).items():
            if k in dp:
                dp[k] += v
    result = chi2_test(torch.stack(rows), law[0])  # rows [n, K]
    print(f"{name}: n={n} p={result.p_value:.3g} stat={result.stat:.1f} df={result.df} "
          f"D={result.divergence:.4f} first drafts accepted={accepted} rejected={rejected} "
          + " ".join(f"{k}={int(v)}" for k, v in dp.items()))
    return result, accepted, rejected, dp


def _assert_lossless(chat, law, name: str, seed0: int) -> None:
    result, accepted, rejected, dp = _sample(chat, law, name, seed0)
    assert accepted >= N // 10 and rejected >= N // 10, (name, accepted, rejected)
    assert result.p_value > ALPHA, (name, result)
    if name == "massv":  # it drafts ahead: blocks drafted for a rejection outcome decided third tokens
        assert dp["spec_branch"] > 0, dp


def _local_chat(app):
    return lambda body: app.openai("chat", body)


def _http_chat(url: str):
    def chat(body: dict) -> dict:
        status, raw = post(f"{url}/v1/chat/completions", body, timeout=600)
        assert status == 200, raw[:500]
        return json.loads(raw)
    return chat


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_data_plane_alone_samples_the_targets_law(local, law, name):
    _assert_lossless(_local_chat(local), law, name, seed0=1_000_000 + DRAFTERS.index(name) * N)


@pytest.mark.parametrize("name", DRAFTERS)
def test_ray_serve_http_samples_the_targets_law(served, law, name):
    _assert_lossless(_http_chat(served), law, name, seed0=2_000_000 + DRAFTERS.index(name) * N)


def test_a_faulted_verifier_on_the_same_path_fails_the_check(local, law, monkeypatch):
    """accept_every_draft_p_allows in LocalApp's verifier (the engine's ``verify_chain``), massv drafting."""
    faults.accept_every_draft_p_allows(monkeypatch)
    result, *_ = _sample(_local_chat(local), law, "massv", seed0=3_000_000)
    assert result.p_value < FAULT_P, result

