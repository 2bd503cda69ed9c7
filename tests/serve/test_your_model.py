"""Bring your own VLM, end to end (issue 63, docs/your-model.md), on both stock layouts (the ``llava15_dir`` and
``qwen25vl_dir`` checkpoints) with the user's conversation file (``conversations_file``):

1. every trainable drafter kind trains a few steps through the real CLI, ``specula train KIND --target DIR --data
   FILE --image-root DIR --answers target --out DIR --export`` (``specula.cli.main`` in-process), and its record
   names the kind and the served checkpoint's weight fingerprint;
2. one ``specula serve MODEL_DIR --drafter DIR`` per layout (a real subprocess on its own local Ray, the first
   trained kind as ``--drafter``; the other trained kinds as ``drafter.alternatives`` of the same deployment, chosen
   per request by the ``drafter`` extension field, since one Ray Serve start per kind does not fit the budget on 2
   cores) answers greedily, for one question with an image and one text only: ``POST /generate`` streams exactly
   plain decoding's tokens (computed in-process: ``SpecEngine(load_target(dir), None)`` on the prompt
   runtime/engine/prompts.py builds), and the ``openai`` client's chat completion (the image as a data: URL) is
   their text, the chosen drafter drafting (``draft_tokens`` > 0, no fallback). "Their text" is what the server's
   detokenizer makes of those tokens in the chunks it emitted them (``your_model_kit.served_text``): random weights
   emit invalid byte runs whose text depends on the chunking;
3. sampled answers through the same served route (Ray Serve HTTP, OpenAI chat completions) follow the target's
   exact law of the first 3 tokens (tests/runtime/distribution_check.py, as test_distributed_distribution.py uses
   it), aasd drafting on LLaVA-1.5, with drafts accepted and rejected; cells are grouped by the texts they can be
   answered as (``your_model_kit.text_law``). The same answers fail against the law at T = 0.1.

Why aasd, T = 0.05: the tiny random-weight targets' top-4 law is almost flat (every one of the 64 cells near 1/64
at T = 1), and a few training steps give drafters whose own distribution is spread wide: at T = 1 every kind had
its first draft accepted under 2% of the time (eagle 2/256, aasd 5/256), so the check would only see rejections.
aasd starts from the target's last layer and reads its KV cache; at T = 0.05 (top_k 4) it measured 100 of 256
first drafts accepted and 156 rejected, so both halves of the rule are exercised. The law is exact at any T.

A (layout, kind) entered in ``KNOWN`` runs as xfail strict (a fix fails the test until the entry goes); none is
today: every kind trains and serves on both layouts.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the shared distribution check

from distribution_check import chi2_test, exact_law  # noqa: E402

from specula.runtime.core.sampling import SamplingParams  # noqa: E402
from specula.zoo.store import weights_fingerprint  # noqa: E402

from ray_kit import post  # noqa: E402
from your_model_kit import (encoded, generate_chunks, image_messages, openai_client, plain_tokens,  # noqa: E402
                            served_text, specula_serve, text_law, text_messages, train)

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray's and the trainers' own

KINDS = ("eagle", "msd", "flash", "aasd", "text_lm", "massv")  # every kind `specula train` has
MAX_TOKENS = 16
KNOWN: dict[tuple[str, str], str] = {}  # (layout, kind) -> the error a kind fails with there (none today)

N, CONCURRENCY, K = 1024, 16, 3  # the sampled check
PARAMS = SamplingParams(temperature=0.05, top_k=4)
SAMPLED = "aasd"


def _known(request, layout: str, kind: str) -> None:
    """A known failure of this (layout, kind) is an expected one (strict: once fixed, the test fails until the entry
    in KNOWN goes)."""
    if (layout, kind) in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN[layout, kind]))


# ------------------------------------------------------------------------------------------------ fixtures
# Class-scoped: each layout's class trains, serves and stops before the next class starts.


@pytest.fixture(scope="class")
def user_model(request):
    """The layout's checkpoint directory (the session fixture ``<LAYOUT>_dir``)."""
    return request.getfixturevalue(f"{request.cls.LAYOUT}_dir")


@pytest.fixture(scope="class")
def trained(request, user_model, conversations_file, tmp_path_factory):
    """kind -> Trained: every kind, a few steps each, through ``specula train``."""
    layout = request.cls.LAYOUT
    root = tmp_path_factory.mktemp(f"your_{layout}")
    out = {}
    for kind in KINDS:
        out[kind] = train(kind, user_model, conversations_file, root)
        print(f"{layout} {kind}: trained in {out[kind].seconds:.1f} s {out[kind].error}")
    return out


@pytest.fixture(scope="class")
def served(request, user_model, trained, tmp_path_factory):
    """``specula serve MODEL_DIR --drafter <first trained kind's dir>`` with the other trained kinds alongside."""
    layout = request.cls.LAYOUT
    ok = [t for t in trained.values() if t.out is not None]
    assert ok, f"no kind trained on {layout}: " + "; ".join(f"{t.kind}: {t.error}" for t in trained.values())
    first, rest = ok[0], ok[1:]
    t0 = time.monotonic()
    with specula_serve(user_model, first.out, {t.kind: (t.kind, t.out) for t in rest},
                       tmp_path_factory.mktemp(f"serve_{layout}")) as s:
        print(f"{layout}: specula serve ready in {time.monotonic() - t0:.0f} s")
        yield s, first.kind


@pytest.fixture(scope="class")
def plain(user_model, conversations_file):
    """Plain greedy decoding's tokens of the image and of the text-only prompt, in-process."""
    return plain_tokens(user_model, conversations_file, MAX_TOKENS)


@pytest.fixture(scope="class")
def tokenizer(user_model):
    from specula.targets.processor import load_processor

    return load_processor(user_model).tokenizer


# ------------------------------------------------------------------------------------------------ tests


class _YourModel:
    """The tests of one layout (subclasses set LAYOUT)."""

    LAYOUT = ""

    @pytest.mark.parametrize("kind", KINDS)
    def test_each_kind_trains_on_the_users_model_and_data(self, request, kind, trained, user_model):
        _known(request, self.LAYOUT, kind)
        t = trained[kind]
        assert t.out is not None, f"specula train {kind} on {self.LAYOUT}: {t.error}"
        rec = json.loads((t.out / "specula.json").read_text())
        assert rec["kind"] == kind
        assert rec["target_sha256"] == weights_fingerprint(user_model)  # what specula serve checks the model against
        assert any(f.suffix == ".safetensors" for f in t.out.iterdir()), sorted(p.name for p in t.out.iterdir())

    @pytest.mark.parametrize("kind", KINDS)
    def test_served_drafter_answers_the_openai_client_with_plain_decodings_text(self, request, kind, trained, served,
                                                                               plain, tokenizer, conversations_file):
        _known(request, self.LAYOUT, kind)
        assert trained[kind].out is not None, f"specula train {kind} on {self.LAYOUT}: {trained[kind].error}"
        s, default = served
        client = openai_client(s.url)
        model = client.models.list().data[0].id
        name = None if kind == default else kind  # the default is --drafter DIR: its requests name none
        for with_image, messages in ((True, image_messages(conversations_file)), (False, text_messages())):
            what = f"{self.LAYOUT} {kind} {'image' if with_image else 'text'}"
            chunks, final = generate_chunks(s.url, conversations_file, with_image, MAX_TOKENS, name)
            assert [t for c in chunks for t in c] == plain[with_image], what  # lossless: plain decoding's tokens
            assert final["drafter"] == "ok" and final["metrics"]["drafter"] == kind, (what, final)
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"drafter": name} if name else {})
            # plain decoding's text: what the server's detokenizer makes of those tokens (= tokenizer.decode of
            # them all unless a byte run of random weights' output decodes differently in pieces; served_text)
            assert chat.choices[0].message.content == served_text(tokenizer, chunks), what
            ext = chat.model_extra["specula"]  # Specula's extension: the chosen drafter really drafted
            assert ext["drafter"] == "ok" and ext["metrics"]["drafter"] == kind, (what, ext)
            assert ext["metrics"]["draft_tokens"] > 0, (what, ext["metrics"])
        assert f"drafter {default}" in s.log.read_text()  # the "specula: serving ..." line names --drafter's kind


class TestLlava15(_YourModel):
    LAYOUT = "llava15"

    @pytest.mark.statistical
    def test_sampled_answers_through_ray_serve_follow_the_targets_law(self, user_model, trained, served,
                                                                     conversations_file):
        """N chat completions (own seeds, T 0.05, top_k 4, max_tokens 3) of the text prompt, aasd drafting, through
        the served HTTP route; their texts against the exact law of plain sampling's first 3 tokens grouped by
        text."""
        from specula.targets.processor import load_processor

        assert trained[SAMPLED].out is not None, trained[SAMPLED].error
        s, _ = served
        tok = load_processor(user_model).tokenizer
        law = exact_law(user_model, encoded(user_model, conversations_file, False).request("law"), PARAMS, K)
        assert not bool((law.cells == tok.eos_token_id).any()), "EOS in the support: a request could stop early"
        grouped, index = text_law(law, tok)

        def chat(seed: int) -> dict:
            body = {"messages": text_messages(), "max_tokens": K, "seed": seed, "temperature": PARAMS.temperature,
                    "top_k": PARAMS.top_k, "drafter": SAMPLED}
            status, raw = post(f"{s.url}/v1/chat/completions", body, timeout=600)
            assert status == 200, raw[:500]
            return json.loads(raw)

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            answers = list(pool.map(chat, range(5_000_000, 5_000_000 + N)))
        rows, accepted, rejected = [], 0, 0
        for a in answers:
            text, ext = a["choices"][0]["message"]["content"], a["specula"]
            assert ext["drafter"] == "ok" and ext["metrics"]["drafter"] == SAMPLED, ext
            assert text in index, f"{text!r} is none of the support's texts"
            rows.append(index[text])
            m = ext["metrics"]
            if m["drafted_at"]:
                accepted += m["accepted_at"][0]
                rejected += m["drafted_at"][0] - m["accepted_at"][0]
        result = chi2_test(torch.tensor(rows)[:, None], grouped)  # rows [N, 1]: each answer's text
        print(f"{SAMPLED} on {self.LAYOUT}: n={N} texts={len(index)} p={result.p_value:.3g} stat={result.stat:.1f} "
              f"df={result.df} first drafts accepted={accepted} rejected={rejected}")
        assert accepted >= N // 10 and rejected >= N // 10, (accepted, rejected)
        assert result.p_value > 1e-4, result
        # the check has power: the same answers against plain sampling at T 0.1 (same support, other law) fail it
        other, other_index = text_law(exact_law(user_model, encoded(user_model, conversations_file, False)
                                                .request("law"), SamplingParams(temperature=0.1, top_k=4), K), tok)
        texts = [a["choices"][0]["message"]["content"] for a in answers]
        wrong = chi2_test(torch.tensor([other_index[t] for t in texts])[:, None], other)
        print(f"against T 0.1: p={wrong.p_value:.3g} stat={wrong.stat:.1f} df={wrong.df}")
        assert wrong.p_value < 1e-6, wrong


class TestQwen25vl(_YourModel):
    LAYOUT = "qwen25vl"


# ------------------------------------------------------------------------------------------------ errors


def test_a_bad_record_is_named_before_anything_trains(llava15_dir, conversations_file, tmp_path, capsys):
    """Every bad record in one error, file / record / line / id and what is wrong; exit status 2, nothing trained."""
    from specula.cli import main

    good = conversations_file.read_text().splitlines()[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        good,
        json.dumps({"id": "no-picture", "image": "images/missing.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A square."}]}),
        json.dumps({"id": "answer-first", "conversations": [{"from": "gpt", "value": "Hello."}]})]) + "\n")
    rc = main(["train", "eagle", "--target", str(llava15_dir), "--data", str(bad), "--image-root",
               str(conversations_file.parent), "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
               "--export", "--samples", "8", "--data-samples", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "2 bad records" in err and "nothing was trained" in err, err
    assert "record 1 (line 2), id 'no-picture'" in err and "images/missing.png" in err, err
    assert "record 2 (line 3), id 'answer-first'" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()  # nothing written


def test_a_drafter_trained_for_the_other_layout_is_refused_at_start(llava15_dir, qwen25vl_dir, conversations_file,
                                                                   tmp_path):
    """``specula serve QWEN_DIR --drafter <trained on LLaVA>`` exits 2 before Ray starts, naming both fingerprints
    and the command that trains one for this model."""
    import subprocess

    t = train("text_lm", llava15_dir, conversations_file, tmp_path)
    assert t.out is not None, t.error
    proc = subprocess.run([sys.executable, "-m", "specula.cli", "serve", str(qwen25vl_dir), "--drafter", str(t.out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = proc.stderr
    assert weights_fingerprint(llava15_dir)[:16] in msg and weights_fingerprint(qwen25vl_dir)[:16] in msg, msg
    assert f"specula train text_lm --target {qwen25vl_dir}" in msg, msg
