"""oneDNN packed linears (targets/packed_linear.py): the same products as ``F.linear``, really run through oneDNN,
never stale, never in autograd's way, and on by default for a CPU target (off on request, undone by a later
target over the same model)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from specula.targets import Accept, DraftBlock
from specula.targets import packed_linear as pl

pytestmark = pytest.mark.skipif(not pl.available(), reason="this PyTorch build has no oneDNN packed linear")


def _net(dtype=torch.float32, bias=True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias)).to(dtype)


def _ran_onednn(fn) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any("_linear_pointwise" in e.key for e in prof.key_averages())


@pytest.mark.parametrize("rows", [1, 2, 7, 158])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_f_linear_and_runs_onednn(rows, bias):
    net = _net(bias=bias)
    x = torch.randn(2, rows, 24)  # [B, T, in]
    with torch.no_grad():
        want = net(x)
        assert pl.pack_linears(net) == 2
        assert all(type(m) is pl.PackedLinear and isinstance(m, nn.Linear) for m in (net[0], net[2]))
        assert pl.packed_count(net) == 2
        assert _ran_onednn(lambda: net(x))
        got = net(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        # a non-contiguous input (a slice of a longer sequence)
        longer = torch.randn(2, rows + 3, 24)
        assert torch.allclose(net(longer[:, 1:rows + 1]), F_ref(net, longer[:, 1:rows + 1]), rtol=1e-5, atol=1e-5)


def F_ref(net, x):
    h = torch.nn.functional.linear(x, net[0].weight, net[0].bias)
    return torch.nn.functional.linear(net[1](h), net[2].weight, net[2].bias)


def test_bfloat16_is_packed_too():
    net = _net(torch.bfloat16)
    x = torch.randn(5, 24).bfloat16()
    with torch.no_grad():
        want = net(x).float()
        assert pl.pack_linears(net) == 2
        assert _ran_onednn(lambda: net(x))
        assert torch.allclose(net(x).float(), want, rtol=2e-2, atol=2e-2)


def test_a_weight_changed_after_packing_is_never_served_stale():
    net = _net()
    x = torch.randn(4, 24)
    pl.pack_linears(net)
    with torch.no_grad():
        net[0].weight.mul_(2.0)  # in place: the packed copy is now stale
        net[2].bias.add_(1.0)
        assert not _ran_onednn(lambda: net(x))  # falls back to F.linear
        assert torch.allclose(net(x), F_ref(net, x), rtol=1e-6, atol=1e-6)
        pl.pack_linears(net)  # repacked from the current weights
        assert _ran_onednn(lambda: net(x))
        assert torch.allclose(net(x), F_ref(net, x), rtol=1e-5, atol=1e-5)


def test_autograd_uses_the_stock_kernel():
    net = _net()
    pl.pack_linears(net)
    x = torch.randn(3, 24, requires_grad=True)
    y = net(x).sum()
    y.backward()
    ref = _net()
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    assert torch.allclose(net[0].weight.grad, ref[0].weight.grad, atol=1e-6)


def test_deepcopy_state_dict_and_unpack():
    net = _net()
    x = torch.randn(3, 24)
    keys = list(net.state_dict())
    pl.pack_linears(net)
    assert list(net.state_dict()) == keys
    twin = copy.deepcopy(net)  # the packed copies are not the module's: the copy runs unpacked
    with torch.no_grad():
        assert pl.packed_count(twin) == 0 and not _ran_onednn(lambda: twin(x))
        assert torch.allclose(twin(x), net(x), rtol=1e-5, atol=1e-5)
    assert pl.unpack_linears(net) == 2
    assert all(type(m) is nn.Linear for m in (net[0], net[2]))
    with torch.no_grad():
        assert not _ran_onednn(lambda: net(x))


def test_auto_packs_a_small_cpu_model_only(monkeypatch):
    assert pl.wanted(_net(), None)
    assert pl.wanted(_net(), True) and not pl.wanted(_net(), False)
    monkeypatch.setattr(pl, "AUTO_MAX_BYTES", 100)
    assert not pl.wanted(_net(), None)  # linear weights over the budget
    with torch.device("meta"):
        meta = _net()
    monkeypatch.undo()
    assert pl.cpu_linear_bytes(meta) == 0 and not pl.wanted(meta, None)
    assert pl.pack_linears(meta) == 0  # nothing on the CPU to pack


def test_target_packs_by_default_and_gives_the_unpacked_logits(kit):
    req = kit.request("r0", [5, 3], [0], seed=3)
    outs = {}
    for packed in (False, None):
        target = kit.target(packed_linears=packed)
        assert (target.linears_packed > 0) == (packed is None)
        assert pl.packed_count(kit.model) == target.linears_packed
        out = {}
        ran = _ran_onednn(lambda: out.setdefault("first", target.prefill([req]).logits))  # [1, V]
        first = out["first"]
        target.commit([Accept("r0", (), int(first.argmax(-1)))])
        ran_verify = _ran_onednn(lambda: out.setdefault(
            "block", target.verify(DraftBlock.chain(["r0"], torch.tensor([[7, 8, 9]])))))  # [1, 4, V]
        block = out["block"]
        assert ran == ran_verify == (packed is None)  # the target's own forwards really take the packed kernel
        outs[packed] = (first, block.logits)
        target.release(["r0"])
    (a0, a1), (b0, b1) = outs[False], outs[None]
    assert torch.allclose(a0, b0, rtol=1e-4, atol=1e-4) and torch.allclose(a1, b1, rtol=1e-4, atol=1e-4)


def test_config_switch_reaches_the_loaded_target(caplog):
    from specula.runtime.config import SpeculaConfig
    from specula.runtime.engine.factory import load_target_for, load_vision_target_for

    with caplog.at_level("INFO", logger="specula.runtime.engine.factory"):
        on = load_target_for(SpeculaConfig(), "cpu")
    assert on.linears_packed > 0
    assert f"{on.linears_packed} linear layers packed for oneDNN" in caplog.text  # a replica's log says so
    off = load_target_for(SpeculaConfig.model_validate({"model": {"packed_linears": False}}), "cpu")
    assert off.linears_packed == 0 and pl.packed_count(off.model) == 0
    vision = load_vision_target_for(SpeculaConfig(), "cpu")  # the vision tower alone: its linears only
    assert 0 < vision.linears_packed == pl.packed_count(vision.model) < on.linears_packed
