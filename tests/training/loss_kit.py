"""Checks shared by the term tests: a term is its own loss, reaches layer 0, is off at weight 0, refuses < 0; a
batch's input embeddings with its images; a head's output read out alone, computed by hand."""

import pytest
import torch

from specula.training.target.batching import collate
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, forward_losses
from specula.training.target.vision_heads import tower_features


def assert_own_term_reaching_layer0(tokenizer, encoded: list, field: str, key: str | None = None) -> None:
    """``TrainConfig(field=1)`` on a tiny deep LM gives the losses {"lm", key} with ``key`` (default ``field``) > 0
    whose gradient reaches layer 0's queries; weight 0 leaves it out; a negative weight is refused."""
    key = key or field
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), tokenizer, seed=0)
    batch = collate(encoded, tokenizer.pad_token_id)
    losses = forward_losses(model, batch, TrainConfig(run_dir="x", freeze_vision=True, **{field: 1.0}))
    assert set(losses) == {"lm", key} and float(losses[key].detach()) > 0
    losses[key].backward()
    q = dict(model.named_parameters())["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert q.grad is not None and float(q.grad.abs().sum()) > 0
    assert key not in forward_losses(model, batch, TrainConfig(run_dir="x", freeze_vision=True))
    with pytest.raises(ValueError, match=field):
        TrainConfig(run_dir="x", **{field: -1.0})


def image_embeds(model, batch):
    """The batch's input embeddings with its images' visual tokens in place: # [B, L, H]."""
    embeds = model.get_input_embeddings()(batch.input_ids)  # [B, L, H]
    img = tower_features(model, batch.pixel_values)[1].reshape(-1, embeds.shape[-1])  # [N_img * T, H]
    mask = (batch.input_ids == model.config.image_token_id).unsqueeze(-1)  # [B, L, 1]
    return embeds.masked_scatter(mask, img.to(embeds.dtype))


def head_readout_by_hand(model, out, layer_i: int, head: int, b: int, q: int) -> torch.Tensor:
    """A head's output at (b, q) from its attention weights and values, through its o_proj columns, the final
    norm's gain and the LM head: # [V]."""
    lm = model.model.language_model
    layer, cfg = lm.layers[layer_i], lm.config
    d = cfg.hidden_size // cfg.num_attention_heads
    kv = head // (cfg.num_attention_heads // cfg.num_key_value_heads)
    values = layer.self_attn.v_proj(layer.input_layernorm(out.hidden_states[layer_i]))  # [B, L, kv_heads * d]
    mixed = out.attentions[layer_i][b, head, q] @ values[b, :, kv * d:(kv + 1) * d]  # [d]
    contrib = mixed @ layer.self_attn.o_proj.weight[:, head * d:(head + 1) * d].T  # [H]
    x = contrib / contrib.pow(2).mean().add(lm.norm.variance_epsilon).sqrt() * lm.norm.weight
    return model.lm_head(x)
