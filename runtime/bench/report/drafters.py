"""Which drafters the report runs: every registered kind, as a chain and as a tree where the kind supports it.

A kind "supports trees" when building it with ``structure="tree"`` succeeds and the drafter's ``spec.structure``
says ``"tree"`` (``ngram`` takes any option silently and stays a chain, so the spec is what decides). A drafter
that cannot be built (weights not shipped, a kind no one has implemented yet) is listed as missing with the reason,
so the report says what it could not measure instead of leaving it out silently.

    found = discover(None, target, tokenizer)        # defaults: every kind, chain + tree
    found.available  -> [Available("ngram", {"kind": "ngram"}, <NgramDrafter>), ...]
    found.missing    -> [{"label": "text_lm", "reason": "weights not shipped: ..."}, ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specula.runtime.bench.spec import config_label, make_drafter

# the seed papers' drafting methods: paper -> (the kind its drafter registers, what it is); claims.py reads these
PAPER_KINDS = {
    "msd": ("msd", "MSD: decoupled visual tokens, two-stage training"),
    "flash": ("flash", "FLASH: latent-aware compression, semi-autoregressive head"),
    "aasd": ("aasd", "AASD: target KV cache, KV projector, target-draft attention"),
    "massv": ("massv", "MASSV: small LM + projector over the target's vision features, self-distilled"),
    "ibed": ("ensemble", "IbED: in-batch ensemble of multimodal / text / caption / pooled drafting"),
}
# the ensemble as IbED publishes it; the default ensemble calls its other members in on demand (drafters.md)
IBED_AS_PUBLISHED = {"kind": "ensemble", "join": "at_once", "label": "ensemble/at_once"}
# kinds that exist for tests, not as drafting methods: left out of the defaults, said so in the report
TEST_ONLY = {"random": "adversarial test drafter (random tokens); add it with --drafters random"}


@dataclass(frozen=True)
class Available:
    label: str  # how the report names it: kind, kind/tree, or the config's "label"
    config: dict  # what builds it again (make_drafter)
    drafter: object = field(repr=False, compare=False)

    @property
    def kind(self) -> str:
        return self.config["kind"]

    @property
    def structure(self) -> str:
        return self.drafter.spec.structure


@dataclass
class Found:
    available: list[Available] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)  # {"label", "reason"}

    def to_json(self) -> dict:
        return {"available": [{"label": a.label, "kind": a.kind, "structure": a.structure, "config": a.config,
                               "needs": sorted(a.drafter.spec.needs)} for a in self.available],
                "missing": list(self.missing)}


def _reason(e: Exception) -> str:
    if isinstance(e, FileNotFoundError):
        return f"weights not shipped: {e}"
    return f"{type(e).__name__}: {e}"


def default_configs() -> tuple[list[dict], list[dict]]:
    """(configs to try, kinds skipped with a reason): every registered kind as chain + tree, the paper kinds that
    have no registered drafter as missing."""
    from specula.drafters.registry import kinds

    registered = kinds()
    configs, skipped = [], []
    for kind in registered:
        if kind in TEST_ONLY:
            skipped.append({"label": kind, "reason": TEST_ONLY[kind]})
            continue
        configs += [{"kind": kind}, {"kind": kind, "structure": "tree"}]
        if kind == "ensemble":  # IbED as its paper runs it (every member from the first block): the claim's subject
            configs.append(dict(IBED_AS_PUBLISHED))
    for kind, what in PAPER_KINDS.values():
        if kind not in registered:
            skipped.append({"label": kind, "reason": f"not implemented in this checkout: no drafter kind {kind!r} "
                                                     f"is registered ({what})"})
    return configs, skipped


def not_requested(configs: list[dict]) -> list[dict]:
    """With an explicit drafter list: the registered and paper kinds it leaves out, so claims can say why."""
    from specula.drafters.registry import kinds

    asked = {c.get("kind") for c in configs}
    paper = {kind for kind, _ in PAPER_KINDS.values()}
    return [{"label": k, "reason": "not requested (--drafters)" if k in kinds() else
             "not implemented in this checkout: no drafter kind registered"}
            for k in sorted((set(kinds()) | paper) - asked - set(TEST_ONLY))]


def discover(configs: list[dict] | None, target, tokenizer) -> Found:
    """Build ``configs`` (None: ``default_configs()``); keep those that build, say why the others did not."""
    found = Found()
    if configs is None:
        configs, found.missing = default_configs()
    else:
        found.missing = not_requested(configs)
    seen: set[str] = set()
    for cfg in configs:
        label = config_label(cfg)
        try:
            drafter = make_drafter(cfg, target, tokenizer)
        except Exception as e:  # a drafter that cannot be built is reported, not fatal
            found.missing.append({"label": label, "reason": _reason(e)})
            continue
        wanted = cfg.get("structure")
        if wanted is not None and drafter.spec.structure != wanted:
            found.missing.append({"label": label, "reason": f"{cfg['kind']} builds a {drafter.spec.structure}, "
                                                            f"not a {wanted} (no {wanted} support)"})
            continue
        if drafter.spec.structure == "tree" and "label" not in cfg and not label.endswith("/tree"):
            label += "/tree"
        while label in seen:
            label += "'"
        seen.add(label)
        found.available.append(Available(label, dict(cfg), drafter))
    found.missing = _merge_variants(found.missing)
    return found


def _merge_variants(missing: list[dict]) -> list[dict]:
    """``kind`` and ``kind/tree`` missing for the same reason (their weights are not shipped) -> one line."""
    reasons = {m["label"]: m["reason"] for m in missing}
    out = []
    for m in missing:
        label = m["label"]
        if label.endswith("/tree") and reasons.get(label[: -len("/tree")]) == m["reason"]:
            continue
        if reasons.get(label + "/tree") == m["reason"]:
            m = {"label": label, "reason": m["reason"] + " (chain and tree)"}
        out.append(m)
    return out
