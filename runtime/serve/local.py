"""``LocalApp``: the application in one process, without Ray: the same four engines the deployments wrap, wired
directly; the drafter still runs a real DrafterService on loopback gRPC, so the data plane is the deployed one
(unless the config says ``drafter.colocate: true``; null means separate here, where there is no cluster to judge;
likewise ``deployments.vision_encoder.colocate: true`` has the verifier encode the images, with no VisionEngine)::

    with LocalApp.from_config(load_config("specula.yaml")) as app:
        app.generate({"prompt": "What colour is the circle?", "images": [b64_png], "max_tokens": 32})
        for record in app.stream({...}): ...          # the NDJSON records of POST /generate with stream: true
        app.openai("chat", {"messages": [...], "max_tokens": 32})   # the JSON of POST /v1/chat/completions
        app.openai("chat", {..., "stream": True})     # its SSE chunk objects, in order (without [DONE])
        app.openai("completions", {"prompt": "...", "max_tokens": 8})
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace

from specula.runtime.dataplane import DrafterServer
from specula.runtime.engine.compute_thread import compute_thread
from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.openai_api import OpenAIApi
from specula.runtime.serve.verifier import VerifierEngine
from specula.runtime.serve.vision import VisionEngine


class LocalApp:
    def __init__(self, ingress: IngressEngine, vision: VisionEngine | None, verifier: VerifierEngine,
                 drafter: DrafterServer | None = None) -> None:
        self.ingress, self.vision, self.verifier, self.drafter = ingress, vision, verifier, drafter
        self.openai_api = OpenAIApi(ingress)

    @classmethod
    def from_config(cls, config) -> LocalApp:
        drafter = None
        if config.drafter.gamma > 0 and not config.drafter.colocate:  # null: a DrafterService, as documented above
            drafter = DrafterServer.from_config(config)
            drafter.start()
        vision = None  # or on the process's compute thread, where it runs too (runtime/engine/compute_thread.py)
        if not config.deployments.vision_encoder.colocate:
            vision = compute_thread().call(VisionEngine.from_config, config)
        return cls(IngressEngine.from_config(config), vision, VerifierEngine.from_config(config), drafter)

    def stream(self, body: dict | bytes) -> Iterator[dict]:
        """The records of ``POST /generate`` with ``stream: true`` (RequestError / VerifierError on failure)."""
        resp, chunks = self._start(body)
        for chunk in chunks:
            yield from resp.add(chunk)

    def generate(self, body: dict | bytes) -> dict:
        """The JSON of ``POST /generate`` with ``stream: false``."""
        resp, chunks = self._start(body)
        for chunk in chunks:
            resp.add(chunk)
        return resp.result()

    def openai(self, kind: str, body: dict | bytes) -> dict | list[dict]:
        """``POST /v1/chat/completions`` (kind "chat") or ``/v1/completions`` ("completions"): the JSON answer, or
        with ``stream: true`` the SSE chunk objects in order. RequestError (with .status, .param) when refused."""
        api = self.openai_api
        plan = api.parse(kind, body)
        req = api.prepare(plan, uuid.uuid4().hex)
        detok, shaper = self.ingress.detokenizer(req), api.shaper(plan, req)
        objects: list[dict] = []
        chunks = self.run(req)
        try:
            for chunk in chunks:
                out = detok.add(chunk)
                objects += shaper.add(out)
                if out["finished"]:
                    break
        finally:
            chunks.close()  # a stop string ended it early: cancel the verifier request
        return objects if plan.stream else shaper.result()

    def run(self, request: GenerationRequest) -> Iterator[dict]:
        """The Ingress deployment's ``run`` in one process: vision encode, then the verifier's chunks (closing the
        iterator early cancels the request)."""
        req = IngressEngine.upstream(request)
        if req.pixel_values is not None and self.vision is not None:  # the VisionEncoder's step
            visual = compute_thread().call(self.vision.encode, req.pixel_values, req.image_grid_thw)
            req = replace(req, visual=visual)
        address = self.drafter.address if self.drafter is not None else None
        yield from self.verifier.stream(req, drafter_address=address)

    def _start(self, body: dict | bytes):
        req = self.ingress.prepare(self.ingress.parse(body), uuid.uuid4().hex)
        return self.ingress.response(req), self.run(req)

    def close(self) -> None:
        self.verifier.close()
        if self.drafter is not None:
            self.drafter.stop()

    def __enter__(self) -> LocalApp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
