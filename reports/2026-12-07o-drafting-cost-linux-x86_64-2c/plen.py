import torch, uuid
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.config import load_config
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.openai_api import OpenAIApi
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "vqa", "reasoning"], 3)
api = OpenAIApi(IngressEngine.from_config(load_config({})))
for p in prompts:
    plan = api.parse("chat", {"model": "target", "messages": p.messages, "max_tokens": 64})
    req = api.prepare(plan, uuid.uuid4().hex)
    enc = p.encoded.request("x", None) if False else p.encoded
    ids = getattr(enc, "input_ids", None)
    px = getattr(enc, "pixel_values", None)
    same_ids = ids is not None and torch.equal(ids.flatten(), req.input_ids.flatten())
    same_px = (px is None and req.pixel_values is None) or (px is not None and req.pixel_values is not None and px.shape == req.pixel_values.shape and torch.allclose(px, req.pixel_values))
    print(p.prompt_id, None if ids is None else ids.numel(), req.input_ids.numel(), same_ids, same_px,
          None if req.pixel_values is None else (req.pixel_values.is_contiguous(), req.pixel_values.dtype, px.is_contiguous() if px is not None else None))
