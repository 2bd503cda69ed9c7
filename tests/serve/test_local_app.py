"""The whole application in one process (LocalApp: ingress, vision, verifier, drafter over loopback gRPC):
an HTTP-shaped request gives the single-process engine's tokens and text, streamed or not; bad requests are
refused with the field or limit named. The OpenAI translation (openai_api.py) runs here without HTTP: chat equals
/generate, streamed equals whole, stop strings, image sources, and each refusal with its status and field."""

from __future__ import annotations

import base64

import pytest
import torch

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp, RequestError
from specula.runtime.engine.factory import make_drafter
from specula.runtime.serve.vision import VisionEngine
from specula.targets import load_target

from serve_kit import make_config, world_body


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from specula.world import generate

    root = tmp_path_factory.mktemp("images")
    (root / "inside").mkdir()
    generate("vqa", "eval", 0).images[0].save(root / "inside" / "vqa0.png")
    generate("vqa", "eval", 0).images[0].save(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def app(model_dir, image_dir):
    cfg = make_config(model_dir, limits={"max_images": 4, "max_tokens": 64, "image_dir": str(image_dir / "inside")})
    with LocalApp.from_config(cfg) as a:
        yield a, cfg


def _reference(model_dir, cfg, app, body):
    """SpecEngine in one process, the target reading pixels itself (no separate vision step, no gRPC)."""
    req = app.ingress.prepare(app.ingress.parse(body), "ref")
    eng = SpecEngine(load_target(model_dir), make_drafter(cfg), gamma=cfg.drafter.gamma)
    return eng.generate([req])["ref"]


@pytest.mark.parametrize("sample", [0, 3, 2])  # one image, several images, text only
def test_generate_equals_the_single_process_engine(model_dir, app, sample):
    a, cfg = app
    body = world_body(sample, max_tokens=16)
    ref = _reference(model_dir, cfg, a, body)
    got = a.generate(body)
    assert got["tokens"] == ref.tokens
    assert got["text"] == a.ingress.tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert got["finish_reason"] == ref.finish_reason and got["drafter"] == "ok"
    assert got["usage"]["completion_tokens"] == len(ref.tokens)


def test_stream_records_rebuild_the_answer(app):
    a, _ = app
    body = world_body(1, max_tokens=16)
    whole = a.generate(body)
    records = list(a.stream({**body, "stream": True}))
    assert records[-1]["finished"] is True and records[-1]["finish_reason"] == whole["finish_reason"]
    assert [t for r in records[:-1] for t in r["tokens"]] == whole["tokens"]
    assert "".join(r["text"] for r in records[:-1]) == whole["text"]


def test_vision_batches_requests_without_changing_features(model_dir, processor):
    vision = VisionEngine(load_target(model_dir))
    pix = [processor.image_processor(images=[im], return_tensors="pt")["pixel_values"]
           for im in _images(3)]
    alone = [vision.encode(p).features for p in pix]
    together = vision.encode_many([(p, None) for p in pix])
    for a, b in zip(alone, together):
        assert torch.allclose(a, b.features, atol=1e-5)


def _images(n):
    from specula.world import generate

    out = []
    i = 0
    while len(out) < n:
        out += list(generate("vqa", "eval", i).images)
        i += 1
    return out[:n]


@pytest.mark.parametrize("body, match", [
    ({"prompt": "hi", "max_tokens": 4, "temprature": 0.5}, "temprature: unknown key"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens 1000 > the limit 64"),
    ({"prompt": "hi", "images": ["not base64!"]}, r"images\[0\]: not valid base64"),
    ({"prompt": "hi", "images": [base64.b64encode(b"GIF89a....").decode()]}, r"images\[0\]: cannot be decoded"),
    ({"prompt": "hi", "images": ["aGk="] * 5}, "5 images > max_images=4"),
    ({"prompt": "<image><image>two?", "images": []}, "2 '<image>' markers for 0 images"),
])
def test_bad_requests_are_refused_naming_the_problem(app, body, match):
    a, _ = app
    with pytest.raises(RequestError, match=match):
        a.generate(body)


def test_body_that_is_not_json_is_refused(app):
    a, _ = app
    with pytest.raises(RequestError, match="not JSON"):
        a.generate(b"{nope")


# ----------------------------------------------------------------------------------------------- OpenAI API


def _chat_body(sample: int, max_tokens: int = 16, **extra) -> dict:
    """World sample ``sample`` as an OpenAI chat body: its images as data: URLs where the prompt says <image>."""
    body = world_body(sample, max_tokens)
    parts, images = [], iter(body["images"])
    for i, text in enumerate(body["prompt"].split("<image>")):
        if i:
            parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{next(images)}"}})
        if text:
            parts.append({"type": "text", "text": text})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, **extra}


def _model_name(a) -> str:
    return a.ingress.model_name


@pytest.mark.parametrize("sample", [0, 3, 2])  # one image, several images, text only
def test_chat_completion_equals_generate(app, sample):
    a, _ = app
    want = a.generate({**world_body(sample, 12), "temperature": 0.8, "seed": sample})
    assert want["text"]
    body = {**_chat_body(sample, 12, temperature=0.8, seed=sample), "model": _model_name(a)}
    got = a.openai("chat", body)
    assert got["object"] == "chat.completion" and got["model"] == _model_name(a)
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want["text"], "refusal": None}
    assert got["choices"][0]["finish_reason"] == {"eos": "stop", "length": "length"}[want["finish_reason"]]
    assert got["usage"] == {"prompt_tokens": want["usage"]["prompt_tokens"],
                            "completion_tokens": len(want["tokens"]),
                            "total_tokens": want["usage"]["prompt_tokens"] + len(want["tokens"])}
    spec = got["specula"]
    assert spec["drafter"] == "ok" and spec["metrics"]["accepted_tokens"] == want["metrics"]["accepted_tokens"]


def test_chat_stream_equals_whole_for_a_seed(app):
    a, _ = app
    body = {**_chat_body(0, 16, temperature=0.9, seed=7, top_p=0.95, top_k=50, min_p=0.01)}
    whole = a.openai("chat", body)
    chunks = a.openai("chat", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] and text
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_string_cuts_the_answer_and_streams_no_part_of_it(app):
    a, _ = app
    body = _chat_body(2, 24, temperature=0.9, seed=1)  # the random tiny model's greedy text is empty
    full = a.openai("chat", body)["choices"][0]["message"]["content"]
    assert len(full) > 8
    k = len(full) // 2
    stop = full[k:k + 3]
    cut = full.find(stop)
    got = a.openai("chat", {**body, "stop": [stop, "never-seen-stop"]})
    assert got["choices"][0]["message"]["content"] == full[:cut]
    assert got["choices"][0]["finish_reason"] == "stop" and got["specula"]["finish_reason"] == "stop"
    chunks = a.openai("chat", {**body, "stop": stop, "stream": True})
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == full[:cut]
    body = {"prompt": "How much is 8 times 0?", "max_tokens": 24, "temperature": 0.9, "seed": 2}
    t = a.openai("completions", body)["choices"][0]["text"]  # completions take stop strings too
    assert len(t) > 4
    got = a.openai("completions", {**body, "stop": t[2:4]})
    assert got["choices"][0]["text"] == t[:t.find(t[2:4])] and got["choices"][0]["finish_reason"] == "stop"


def test_completions_text_and_token_prompts(app):
    a, _ = app
    tok = a.ingress.tokenizer
    got = a.openai("completions", {"model": _model_name(a), "prompt": "How much is 8 times 0?", "max_tokens": 6,
                                   "temperature": 0.9, "seed": 3})
    assert got["choices"][0]["text"]
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] <= 6
    ids = [tok.bos_token_id] + tok("How much is 8 times 0?")["input_ids"]
    same = a.openai("completions", {"prompt": ids, "max_tokens": 6, "temperature": 0.9, "seed": 3})
    assert same["choices"][0]["text"] == got["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == len(ids)
    chunks = a.openai("completions", {"prompt": ["How much is 8 times 0?"], "max_tokens": 6, "temperature": 0.9,
                                      "seed": 3, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == got["choices"][0]["text"]
    assert a.openai("completions", {"prompt": "hi", "temperature": 0})["usage"]["completion_tokens"] <= 16


def test_image_sources_files_under_image_dir_only(app, image_dir):
    a, _ = app
    body = _chat_body(0, 8, temperature=0.9, seed=4)
    want = a.openai("chat", body)["choices"][0]["message"]["content"]
    assert want
    part = next(p for p in body["messages"][0]["content"] if p["type"] == "image_url")
    for url in (str(image_dir / "inside" / "vqa0.png"), (image_dir / "inside" / "vqa0.png").as_uri(), "vqa0.png"):
        part["image_url"] = {"url": url, "detail": "high"}
        assert a.openai("chat", body)["choices"][0]["message"]["content"] == want, url
    for url, match in ((str(image_dir / "outside.png"), "not a file under"),
                       ("inside/../../outside.png", "no such file|not a file under"),
                       ("../outside.png", "not a file under"),
                       ("http://127.0.0.1:9/x.png", "remote image URLs are off"),
                       ("ftp://x/y.png", "unsupported URL scheme"),
                       ("data:image/png,abc", "must be base64")):
        part["image_url"] = {"url": url}
        with pytest.raises(RequestError, match=match) as e:
            a.openai("chat", body)
        assert e.value.status == 400 and e.value.param == "messages[0].content[0].image_url.url"


def _b64_png(size=(8, 8)) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("kind, body, status, param, match", [
    ("chat", b"{nope", 400, None, "not JSON"),
    ("chat", b"[1, 2]", 400, None, "JSON object"),
    ("chat", {"messages": _MSG, "temprature": 0.5}, 400, "temprature", "unknown field"),
    ("chat", {"messages": []}, 400, "messages", "at least 1"),
    ("chat", {}, 400, "messages", "Field required"),
    ("chat", {"messages": _MSG, "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    ("chat", {"messages": _MSG, "temperature": -1}, 400, "temperature", "greater than or equal"),
    # booleans, integers and numbers are strict JSON types: a string or a boolean in their place is never coerced
    ("chat", {"messages": _MSG, "stream": "yes"}, 400, "stream", "valid boolean"),
    ("chat", {"messages": _MSG, "stream": 1}, 400, "stream", "valid boolean"),
    ("chat", {"messages": _MSG, "stream": True, "stream_options": {"include_usage": "true"}}, 400,
     "stream_options.include_usage", "valid boolean"),
    ("chat", {"messages": _MSG, "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ("chat", {"messages": _MSG, "seed": True}, 400, "seed", "valid integer"),
    ("chat", {"messages": _MSG, "temperature": "0.5"}, 400, "temperature", "valid number"),
    ("completions", {"prompt": "hi", "echo": "false"}, 400, "echo", "valid boolean"),
    ("chat", {"messages": _MSG, "max_tokens": 1000}, 400, "max_tokens", "max_tokens 1000 > the limit 64"),
    ("chat", {"messages": _MSG, "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens",
     "disagree"),
    ("chat", {"messages": _MSG, "n": 2}, 400, "n", "only n=1"),
    ("chat", {"messages": _MSG, "logprobs": True}, 400, "logprobs", "not supported"),
    ("chat", {"messages": _MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "not supported"),
    ("chat", {"messages": _MSG, "response_format": {"type": "json_object"}}, 400, "response_format", "only text"),
    ("chat", {"messages": _MSG, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("chat", {"messages": _MSG, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream: true"),
    ("chat", {"messages": _MSG, "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("chat", {"messages": _MSG, "drafter": "eagle"}, 400, "drafter", "'eagle' is not served here"),
    ("chat", {"messages": _MSG, "stop": [""]}, 400, "stop", "non-empty"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "a <image> b"}]}, 400, "messages[0].content",
     "image token"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content[0].type", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x",
                                                                                           "zoom": 2}}]}]},
     400, "messages[0].content[0]", "an image part is"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}]}]}, 400,
     "messages[0].content[0].image_url.url", "not valid base64"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64_png()}}] * 5}]}, 400,
     "messages", "5 images > max_images=4"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/gif;base64," + base64.b64encode(
            b"GIF89a....").decode()}}]}]}, 400, "messages[0].content[0].image_url.url", "cannot be decoded"),
    ("chat", {"messages": [{"role": "user", "content": "cat " * 5000}]}, 400, "messages", "max_prompt_tokens"),
    ("completions", {"prompt": "cat " * 5000}, 400, "prompt", "max_prompt_tokens"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"prompt": "a <image>"}, 400, "prompt", "image token"),
    ("completions", {"prompt": [10**9]}, 400, "prompt", "outside"),
    ("completions", {"prompt": "a", "echo": True}, 400, "echo", "not supported"),
    ("completions", {"prompt": "a", "best_of": 3}, 400, "best_of", "best_of=1"),
    ("completions", {"prompt": "a", "messages": _MSG}, 400, "messages", "unknown field"),
])
def test_openai_refusals_name_status_and_field(app, kind, body, status, param, match):
    a, _ = app
    with pytest.raises(RequestError, match=match) as e:
        a.openai(kind, body)
    assert (e.value.status, e.value.param) == (status, param)


def test_ignorable_openai_fields_are_accepted(app):
    a, _ = app
    base = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "u"}],
            "max_tokens": 3, "temperature": 0.9, "seed": 5}
    plain = a.openai("chat", base)
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "n": 1, "logprobs": False, "presence_penalty": 0,
             "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": True,
             "drafter": "ngram", "stop": None}
    got = a.openai("chat", {**base, **extra})
    assert got["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_detokenizer_holds_back_what_may_start_a_stop_string():
    from specula.runtime.serve.ingress import Detokenizer

    class Pieces:  # token i decodes to PIECES[i]: a tokenizer whose text is exactly the pieces joined
        def decode(self, ids, skip_special_tokens=True):
            return "".join(PIECES[i] for i in ids)

    PIECES = ["Hel", "lo", " wo", "r", "ld", "!"]
    chunks = [{"tokens": [i], "finished": i == 5, "finish_reason": "eos" if i == 5 else None} for i in range(6)]
    d = Detokenizer(Pieces(), stop=("world",))
    out = [d.add(c) for c in chunks[:5]]
    assert [o["text"] for o in out] == ["Hel", "lo", " ", "", ""]  # "wo", "wor" held: they may begin "world"
    assert out[-1]["finished"] and out[-1]["finish_reason"] == "stop" and out[-1]["metrics"] is None
    assert d.text == "Hello "  # the answer ends just before the stop string
    d = Detokenizer(Pieces(), stop=("wox",))
    texts = [d.add(c)["text"] for c in chunks]
    assert "".join(texts) == "Hello world!" and texts[2] == " "  # "wo" held until "r" rules "wox" out


def test_metrics_exposition_counts_what_the_verifier_reported(app):
    parser = pytest.importorskip("prometheus_client.parser")
    from specula.runtime.serve.admission import Admission
    from specula.runtime.serve.prometheus import GenerationMeter, ServeMetrics

    a, _ = app
    metrics = ServeMetrics(Admission(2, 2))
    finals = []
    for i, body in enumerate([world_body(0, 12), world_body(2, 12)]):
        req = a.ingress.prepare(a.ingress.parse({**body, "temperature": 0.9, "seed": i}), f"m{i}")
        meter = GenerationMeter(metrics, int(req.input_ids.numel()))
        for chunk in a.run(req):
            meter.add(chunk)
        finals.append(chunk)
        metrics.request("/generate", 200)
    metrics.request("/generate", 400)
    families = {f.name: f for f in parser.text_string_to_metric_families(metrics.render())}

    def value(name, **labels):
        return sum(s.value for s in families[name].samples
                   if s.name == families[name].name + ("_total" if families[name].type == "counter" else "")
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    ms = [c["metrics"] for c in finals]
    assert value("specula_requests", route="/generate", code="200") == 2
    assert value("specula_requests", code="400") == 1
    assert value("specula_generations", reason="length") == 2
    assert value("specula_spec_draft_tokens") == sum(m["draft_tokens"] for m in ms) > 0
    assert value("specula_spec_accepted_tokens") == sum(m["accepted_tokens"] for m in ms)
    assert value("specula_spec_accepted_per_position", position="1") == sum((m["accepted_at"] or [0])[0] for m in ms)
    assert value("specula_spec_drafts") == sum((m["drafted_at"] or [0])[0] for m in ms) > 0
    blocks = sum(m["blocks"] for m in ms)
    assert value("specula_spec_tau") == pytest.approx((value("specula_spec_accepted_tokens") + blocks) / blocks)
    assert value("specula_time_seconds", phase="verify") > 0
    assert value("specula_requests_running") == 0 and value("specula_requests_queued") == 0
    assert families["specula_request_duration_seconds"].type == "histogram"


def test_remote_images_only_when_allowed(tmp_path):
    """http(s) image URLs: refused by default; when allowed, fetched (here from a loopback server) within the byte
    limit, and a failed fetch is the client's 400, not a server error."""
    import http.server
    import threading

    from specula.runtime.config import LimitsConfig
    from specula.runtime.serve.images import ImageLoader

    png = base64.b64decode(_b64_png((16, 12)))
    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "big.png").write_bytes(png + b"\0" * 4096)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RequestError, match="remote image URLs are off"):
            ImageLoader(LimitsConfig()).from_url(f"{base}/a.png", "url")
        loader = ImageLoader(LimitsConfig(allow_remote_images=True, max_image_bytes=len(png) + 100))
        assert loader.from_url(f"{base}/a.png", "url").size == (16, 12)
        with pytest.raises(RequestError, match="max_image_bytes"):
            loader.from_url(f"{base}/big.png", "url")
        with pytest.raises(RequestError, match="url: fetching the image failed"):
            loader.from_url(f"{base}/missing.png", "url")
    finally:
        server.shutdown()
        server.server_close()


def test_pixel_limit_is_checked_before_decoding():
    from PIL import Image

    from specula.runtime.config import LimitsConfig
    from specula.runtime.serve.images import ImageLoader

    before = Image.MAX_IMAGE_PIXELS
    try:
        loader = ImageLoader(LimitsConfig(max_image_pixels=100 * 100))
        assert Image.MAX_IMAGE_PIXELS == 100 * 100  # PIL's own guard follows the limit
        assert loader.from_base64(_b64_png((100, 100)), "img").size == (100, 100)
        with pytest.raises(RequestError, match=r"img: 101x100 pixels > max_image_pixels=10000"), \
                pytest.warns(Image.DecompressionBombWarning):
            loader.from_base64(_b64_png((101, 100)), "img")
        with pytest.raises(RequestError, match=r"img: more than max_image_pixels=10000"):  # PIL's guard
            loader.from_base64(_b64_png((400, 400)), "img")
    finally:
        Image.MAX_IMAGE_PIXELS = before  # process-global: leave it as other tests found it
