"""Bad inputs fail early with a ValueError that says what is wrong, and leave the target usable."""

from __future__ import annotations

import pytest
import torch

from specula.targets import Accept, DraftBlock, PrefillRequest, load_target


@pytest.fixture
def live(kit):
    """A target with two rows that have a pending token."""
    target = kit.target()
    target.prefill([kit.request("a", [3, 2], [0], seed=71), kit.request("b", [4], [], seed=72)])
    target.commit([Accept("a", (), 5), Accept("b", (), 6)])
    return target


def test_image_count_must_match_image_token_groups(kit):
    target = kit.target()
    two = kit.request("x", [2, 2, 2], [0, 0], seed=73)
    one = kit.request("y", [2, 2], [0], seed=74)
    mixed = PrefillRequest("x", two.input_ids, one.pixel_values, one.image_grid_thw)  # 2 groups, 1 image
    with pytest.raises(ValueError, match=r"2 image-token group\(s\).*1 image\(s\)|image_grid_thw"):
        target.prefill([mixed])
    no_images = PrefillRequest("z", one.input_ids)  # image tokens but no image
    with pytest.raises(ValueError, match=r"1 image-token group\(s\).*0 image\(s\)"):
        target.prefill([no_images])
    text_with_image = kit.request("t", [4], [], seed=75)
    stray = PrefillRequest("t", text_with_image.input_ids, one.pixel_values, one.image_grid_thw)
    with pytest.raises(ValueError, match=r"0 image-token group\(s\)"):
        target.prefill([stray])
    assert target.live_ids == ()


def test_empty_prompt(kit):
    with pytest.raises(ValueError, match="empty prompt"):
        kit.target().prefill([PrefillRequest("e", torch.tensor([], dtype=torch.long))])
    with pytest.raises(ValueError, match="at least one request"):
        kit.target().prefill([])


def test_wrong_pixel_shapes(kit):
    target = kit.target()
    req = kit.request("p", [2, 2], [0], seed=76)
    bad = req.pixel_values[..., :-1]  # LLaVA: 27 px wide; Qwen: patch rows one value short
    with pytest.raises(ValueError, match="pixel_values must be"):
        target.prefill([PrefillRequest("p", req.input_ids, bad, req.image_grid_thw)])
    with pytest.raises(ValueError, match="pixel_values must be"):
        target.encode_images(bad, image_grid_thw=req.image_grid_thw)


def test_qwen_needs_image_grid(qwen_kit):
    req = qwen_kit.request("p", [2, 2], [0], seed=77)
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen_kit.target().prefill([PrefillRequest("p", req.input_ids, req.pixel_values)])


def test_unknown_request_id(live):
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        live.verify(DraftBlock.chain(["nope"], torch.tensor([[7]])))
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        live.commit([Accept("nope", (), 3)])
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        live.release(["nope"])
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        live.decode_step(["nope"])


def test_draft_token_out_of_range(live):
    vocab = live.info.vocab_size
    with pytest.raises(ValueError, match=rf"token id {vocab} outside"):
        live.verify(DraftBlock.chain(["a"], torch.tensor([[3, vocab]])))
    with pytest.raises(ValueError, match="token id -1 outside"):
        live.verify(DraftBlock.chain(["a"], torch.tensor([[-1]])))
    # Entries past a row's count are padding and are not checked.
    live.verify(DraftBlock.chain(["a", "b"], torch.tensor([[3, 4], [5, vocab + 7]]), counts=[2, 1]))


def test_bad_parents(live):
    tokens = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match="a parent must precede its child"):
        live.verify(DraftBlock(("a",), tokens, torch.tensor([[-1, 2, 0]])))
    with pytest.raises(ValueError, match="a parent must precede its child"):
        live.verify(DraftBlock(("a",), tokens, torch.tensor([[-1, 1, 0]])))  # self-parent
    with pytest.raises(ValueError, match="a parent must precede its child"):
        live.verify(DraftBlock(("a",), tokens, torch.tensor([[-2, 0, 0]])))
    with pytest.raises(ValueError, match="must match tokens"):
        live.verify(DraftBlock(("a",), tokens, torch.tensor([[-1, 0]])))
    with pytest.raises(ValueError, match="counts"):
        live.verify(DraftBlock.chain(("a",), tokens, counts=[4]))


def test_bad_commit_paths(live):
    live.verify(DraftBlock(("a", "b"), torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.tensor([[-1, -1, 0], [-1, 0, 1]])))
    with pytest.raises(ValueError, match="not root-to-leaf"):
        live.commit([Accept("a", (2,), 9), Accept("b", (0,), 9)])  # node 2 hangs off node 0
    with pytest.raises(ValueError, match="not root-to-leaf"):
        live.commit([Accept("a", (0, 1), 9), Accept("b", (0,), 9)])  # siblings
    with pytest.raises(ValueError, match="outside the block"):
        live.commit([Accept("a", (0,), 9), Accept("b", (3,), 9)])
    with pytest.raises(ValueError, match="missing"):
        live.commit([Accept("a", (0, 2), 9)])
    with pytest.raises(ValueError, match="next_token"):
        live.commit([Accept("a", (0, 2), live.info.vocab_size), Accept("b", (), 9)])
    with pytest.raises(ValueError, match="commit it before prefilling|not committed"):
        live.verify(DraftBlock.chain(["a"], torch.tensor([[3]])))
    live.commit([Accept("a", (0, 2), 9), Accept("b", (0, 1, 2), 9)])  # still usable after the errors
    assert live.sequence("a")[-4:] == [5, 3, 5, 9]
    assert live.sequence("b")[-5:] == [6, 6, 7, 8, 9]


def test_protocol_order_errors(kit):
    target = kit.target()
    req = kit.request("a", [3], [], seed=78)
    target.prefill([req])
    with pytest.raises(ValueError, match="no pending token"):
        target.verify(DraftBlock.chain(["a"], torch.tensor([[3]])))
    with pytest.raises(ValueError, match="must be new and unique"):
        target.prefill([req])
    target.commit([Accept("a", (), 5)])
    with pytest.raises(ValueError, match="already has a pending token"):
        target.commit([Accept("a", (), 6)])
    with pytest.raises(ValueError, match="was not verified"):
        target.commit([Accept("a", (0,), 6)])
    target.verify(DraftBlock.chain(["a"], torch.tensor([[3]])))
    with pytest.raises(ValueError, match="commit it before prefilling"):
        target.prefill([kit.request("b", [3], [], seed=79)])


def test_load_target_errors(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        load_target(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_target(tmp_path, dtype="float13")
