"""``massv``: the MASSV drafter (Ganesan et al. 2025): a small LM that reads the target's own vision features
through its own projector (``drafters/massv_model.py``), trained in two phases by ``training/drafters/massv.py``
(projector pretraining on captions with the LM frozen, then self-distilled visual instruction tuning on the
target's own answers; ``--no-sdvit`` is the ablation).

Drafting is the ``ensemble`` drafter with one member, "multimodal": every image token of the prompt becomes the
projector's output for that visual token; then the ``text_lm`` runner's chain or tree drafting over one batched
cache. ``spec.needs`` = {"pre_projector"} (the engine passes ``DraftContext.extra["pre_projector"]`` [N_img, T_max, D],
padded to the longest image) or {"visual"} for a model trained on the target's projected features. Images of any
size (Qwen2.5-VL): each image's token count comes from the prompt ids (``drafters/image_runs.py``).

A massv directory carries the tokenizer it was trained with (``specula train massv`` saves the target's beside the
model): given the target's (``tokenizer``), the two must agree (``drafters/vocab.py``), so a drafter trained for
another target is refused by name instead of drafting ids that mean other tokens.

    drafter = create({"kind": "massv", "path": "massv", "structure": "chain"}, target=target)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

from specula.drafters.ensemble import EnsembleDrafter
from specula.drafters.registration import register


@register("massv")
class MassvDrafter(EnsembleDrafter):
    """Options: those of ``ensemble`` without ``members`` / ``weights`` / ``grid`` / ``captioner`` (one multimodal
    member): ``path`` (default "massv") or ``model``, ``structure``, ``branching``, ``depth``, ``seed``,
    ``image_token_id``, ``kv_policy``, ``device``, ``dtype``, ``attn_implementation``, ``vocab_size``."""

    KIND = "massv"
    DEFAULT_MEMBERS = ("multimodal",)

    def __init__(self, target=None, tokenizer=None, vocab_size: int | None = None, image_token_id: int | None = None,
                 device: str | None = None, **options):
        fixed = {"members", "weights", "grid", "captioner", "caption_max_tokens", "caption_cache"} & set(options)
        if fixed:
            raise ValueError(f"massv: unknown options {sorted(fixed)} (massv has one multimodal member)")
        super().__init__(**options, target=target, tokenizer=tokenizer, vocab_size=vocab_size,
                         image_token_id=image_token_id, device=device)
        if tokenizer is not None and options.get("model") is None:
            self._check_tokenizer(options.get("path", "massv"), tokenizer)

    def _check_tokenizer(self, path, tokenizer) -> None:
        """The tokenizer saved beside the model against the target's (none saved: nothing to compare)."""
        from specula.drafters.text_lm import _own_tokenizer
        from specula.drafters.vocab import as_tokenizer, check_vocab

        own = _own_tokenizer(path)
        if own is not None:
            rows = self.massv.lm.get_output_embeddings().weight.shape[0]
            check_vocab(self.KIND, rows, self.vocab_size, own, as_tokenizer(tokenizer))
