"""Serving helpers of the reliability suite: tiny real weights, configs, world request bodies, and what a test
measures (the process's RSS, the KV bytes a target holds). A uniquely named module (``conftest`` names collide
across folders, and tests/serve's helpers are only importable when that folder was collected).

The target is the embedded architecture at "tiny" size with the world's real tokenizer, its LM weights drawn
larger than the init so greedy answers vary instead of repeating one token; ``text_lm`` is that target's own LM
(its drafts are accepted, so accepted blocks cross the data plane too). Built once per session, in a temp dir.
"""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from collections.abc import Callable

import torch

from specula.runtime.config import load_config

SUITES = ["vqa", "caption", "text", "multi_image", "chart", "reasoning"]


_WEIGHTS: dict[str, object] = {}


def build_weights(tmp_path_factory):
    """Directory with ``target/`` (checkpoint + processor) and ``text_lm/`` (the target's LM); built once per
    session whichever test module asks first (each module's fixture calls this: an imported fixture would be
    one fixture per module, built again)."""
    if "root" in _WEIGHTS:
        return _WEIGHTS["root"]
    from transformers import LlamaForCausalLM

    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    root = tmp_path_factory.mktemp("reliability_weights")
    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.model.language_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    model.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.tie_weights()
    lm.eval().save_pretrained(root / "text_lm")
    _WEIGHTS["root"] = root
    return root


def drafter_options(kind: str, root) -> dict:
    """The drafter section for ``kind`` over ``weights``; no draft-ahead, so a seed fixes the drafter's randomness
    too (with overlap, how far drafting ran ahead depends on timing); deadlines far above any step on a busy
    machine, so a fallback here would be a slow machine, not a bug."""
    options = {"ngram": {"max_n": 3}, "random": {"seed": 0}, "text_lm": {"path": str(root / "text_lm")}}[kind]
    return {"kind": kind, "options": options, "gamma": 3, "overlap": False, "propose_timeout_s": 120.0,
            "connect_timeout_s": 60.0}


def make_config(model_dir, drafter: dict | None = None, **sections):
    """A test config: one torch thread and no reserved CPUs per replica, the public gRPC API on a free port;
    ``deployments`` entries are merged into those defaults."""
    dep = {"num_replicas": 1, "torch_threads": 1, "ray_actor_options": {"num_cpus": 0}}
    deployments = {name: dict(dep) for name in ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier")}
    for name, extra in sections.pop("deployments", {}).items():
        deployments[name].update(extra)
    raw = {
        "model": {"path": str(model_dir)},
        "grpc": {"port": 0},
        "drafter": drafter or {"kind": "ngram", "options": {"max_n": 3}, "gamma": 3},
        "deployments": deployments,
        **sections,
    }
    return load_config(raw)


def png_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def world_body(i: int, max_tokens: int = 16) -> dict:
    """A ``POST /generate`` body from world sample i (eval split): its prompt and images as base64 PNG."""
    from specula.world import generate

    s = generate(SUITES[i % len(SUITES)], "eval", i)
    return {"prompt": s.prompt, "images": [png_b64(im) for im in s.images], "max_tokens": max_tokens}


def chat_body(body: dict) -> dict:
    """A ``POST /generate`` body as the same OpenAI chat body (images as data: URLs where ``<image>`` stands)."""
    parts, images = [], iter(body["images"])
    pieces = body["prompt"].split("<image>")
    if len(pieces) == 1:
        parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{im}"}} for im in images]
    for i, text in enumerate(pieces):
        if i:
            parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{next(images)}"}})
        if text:
            parts.append({"type": "text", "text": text})
    extra = {k: v for k, v in body.items() if k not in ("prompt", "images")}
    return {"messages": [{"role": "user", "content": parts}], **extra}


def rss_mib() -> float:
    """This process's resident set size (VmRSS), MiB."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def kv_bytes(kv) -> int:
    """Bytes of KV cache storage a ``BatchedKV`` (a target's ``.kv``, a text_lm drafter's) holds now: every
    layer's K and V storage, spare capacity included."""
    cache = kv.cache
    if cache is None:
        return 0
    seen, total = set(), 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
    return total


def wait_until(what: str, check: Callable[[], object], bound_s: float = 60.0):
    """Poll ``check`` until truthy; fail naming ``what`` after ``bound_s`` (a bound against hangs, not a timing
    assertion: every caller's condition holds within milliseconds when nothing is wrong)."""
    end = time.monotonic() + bound_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not reached within {bound_s:.0f} s (last {got!r})")
        time.sleep(0.02)


def run_threads(jobs: list[Callable[[], object]], bound_s: float) -> list[object]:
    """Run every job in its own thread, all started together; their results (or exceptions) in order. Fails if
    one is still running after ``bound_s`` (a hang)."""
    out: list[object] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        start.wait()
        try:
            out[i] = jobs[i]()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    end = time.monotonic() + bound_s
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"jobs {stuck} still running after {bound_s:.0f} s: a hang"
    return out


class EventLoopThread:
    """An event loop in a daemon thread: the one a Serve ingress replica serves HTTP and gRPC from."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reliability-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def serve_grpc(loop: EventLoopThread, config, app, admission=None, metrics=None):
    """The public gRPC API (grpc_api.py) on ``loop`` over a LocalApp's engines, as an ingress replica wires it:
    (servicer, started GrpcServer)."""
    from specula.runtime.serve.admission import Admission
    from specula.runtime.serve.grpc_api import PublicApiServicer, local_run, start_grpc_server

    limits = config.limits
    admission = admission or Admission(limits.max_concurrent_requests, limits.max_queued_requests)
    run = local_run(app.vision, app.verifier, app.drafter.address if app.drafter is not None else None)
    servicer = PublicApiServicer.from_config(config, app.ingress, run, admission, metrics)
    return servicer, loop.call(start_grpc_server(config, servicer))
