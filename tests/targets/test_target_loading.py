"""load_target picks the backend from config.model_type and loads local checkpoints without the hub."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specula.targets import LlavaTarget, Qwen2_5_VLTarget, Target, load_target


def test_load_from_local_directory(kit, tmp_path):
    kit.model.save_pretrained(tmp_path)
    target = load_target(tmp_path, device="cpu", dtype="float32", feature_layers=(1, -1))
    assert isinstance(target, LlavaTarget if kit.name == "llava" else Qwen2_5_VLTarget)
    assert isinstance(target, Target)
    assert target.info.model_type == kit.name and target.info.dtype == "float32"
    assert target.info.feature_layers == (1, 2)  # -1 == num_layers: the final-norm state in HF indexing
    req = kit.request("r", [3, 2], [0], seed=81)
    a = target.prefill([req]).logits
    b = kit.target().prefill([req]).logits
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_dtype_cast_and_info(llava_kit):
    target = load_target(copy.deepcopy(llava_kit.model), dtype=torch.bfloat16)  # casts in place: use a copy
    assert target.info.dtype == "bfloat16"
    out = target.prefill([llava_kit.request("r", [3, 2], [0], seed=82)])
    assert out.logits.dtype == torch.float32 and out.features.hidden.dtype == torch.bfloat16


def test_unsupported_model_type(tmp_path):
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no target backend for model_type 'llama'"):
        load_target(tmp_path)
