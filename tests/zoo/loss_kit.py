"""A check shared by the set-term tests: a term is its own loss, reaches layer 0, is off at weight 0, refuses < 0."""

import pytest
import torch

from specula.zoo.batching import collate
from specula.zoo.target_config import TargetArch, build_model
from specula.zoo.train_target import TrainConfig, forward_losses


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
