"""Config -> the objects the engines wrap (target, processor, drafter). No Ray; every deployment and the in-process
app build through here, so a replica and a test load the same thing the same way."""

from __future__ import annotations

import logging
from pathlib import Path

from specula.runtime.config import DeploymentSettings, SpeculaConfig

log = logging.getLogger(__name__)


def model_dir(config: SpeculaConfig) -> Path:
    from specula.zoo.store import resolve

    return resolve(config.model.path)


def load_target_for(config: SpeculaConfig, device: str):
    from specula.targets import load_target

    target = load_target(model_dir(config), device=device, dtype=config.model.dtype,
                         packed_linears=config.model.packed_linears)
    log.info("target %s on %s: %d linear layers packed for oneDNN (model.packed_linears: %s)", config.model.path,
             target.device, target.linears_packed, config.model.packed_linears)
    return target


def load_vision_target_for(config: SpeculaConfig, device: str):
    """The target with only its vision tower and projector loaded (the VisionEncoder's; see vision_weights.py)."""
    from specula.runtime.engine.vision_weights import load_vision_target

    return load_vision_target(model_dir(config), device=device, dtype=config.model.dtype,
                              packed_linears=config.model.packed_linears)


def load_processor_for(config: SpeculaConfig):
    from specula.targets.processor import load_processor

    return load_processor(model_dir(config))


def reads_images_first(config: SpeculaConfig) -> bool:
    """``model.image_parts_first``, or where it is null whether the target is a LLaVA (trained on prompts that open
    with their image; runtime/serve/image_order.py) rather than a Qwen2.5-VL (trained on interleaved ones)."""
    if config.model.image_parts_first is not None:
        return config.model.image_parts_first
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir(config), local_files_only=True).model_type == "llava"


def target_facts(config: SpeculaConfig) -> dict:
    """What a drafter may need to know of the target without loading it: vocab_size, image_token_id."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir(config), local_files_only=True)
    facts = {"vocab_size": int(hf.get_text_config().vocab_size)}
    image = getattr(hf, "image_token_id", None)
    if image is None:
        image = getattr(hf, "image_token_index", None)
    if image is not None:
        facts["image_token_id"] = int(image)
    return facts


def make_drafter(config: SpeculaConfig, device: str | None = None):
    """The drafter of ``config.drafter``; options it leaves out that its class takes by name (``vocab_size``,
    ``image_token_id``, ``device``) come from the target and ``device`` (default: the DrafterEnsemble's). With
    ``drafter.alternatives`` a ``MultiDrafter`` over all of them (the default under ``drafter.default_name``), so
    each request drafts with the one it names."""
    d = config.drafter
    tok: dict = {}  # the served model's tokenizer, loaded once for all the drafters that compare against it
    device = device or config.deployments.drafter_ensemble.device
    default = _one_drafter(config, d.kind, d.options, tok, device)
    if not d.alternatives:
        return default
    from specula.drafters.multi_drafter import MultiDrafter

    subs = {d.default_name: default}
    subs.update({name: _one_drafter(config, a.kind, a.options, tok, device) for name, a in d.alternatives.items()})
    return MultiDrafter(subs, default=d.default_name)


def _one_drafter(config: SpeculaConfig, kind: str, options: dict, tok: dict, device: str):
    from specula.drafters import create, registry

    opts = dict(options)
    named = registry.accepted_options(kind)
    defaults = {**target_facts(config), "device": device}
    for name, value in defaults.items():
        if name in named and name not in opts:
            opts[name] = value
    if "tokenizer" in named and "tokenizer" not in opts:  # a drafter with its own tokenizer is checked against it
        if "t" not in tok:
            tok["t"] = target_tokenizer(config)
        if tok["t"] is not None:
            opts["tokenizer"] = tok["t"]
    return create({"kind": kind, **opts})


def target_tokenizer(config: SpeculaConfig):
    """The served model's tokenizer (its directory's own), or None when the directory has none: what a drafter
    with a tokenizer of its own (text_lm, massv, ensemble) is compared with token by token (drafters/vocab.py)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir(config)), local_files_only=True)
    except (OSError, ValueError):
        return None


def set_threads(settings: DeploymentSettings) -> None:
    """torch's intra-op threads for a replica of ``settings``: its ``torch_threads``, else its reserved whole CPUs
    (``DeploymentSettings.threads``); left alone while neither is known."""
    threads = settings.threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
