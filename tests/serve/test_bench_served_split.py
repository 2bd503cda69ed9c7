"""``bench served``'s accounting, without Ray: which apps run while each runner runs (``round_robin``), and the
split of the served runtime's time into Ray's background and the request path (``served_split``)."""

from __future__ import annotations

import pytest

from specula.runtime.bench.served import (BESIDE, Prompt, round_robin, served_per_suite, served_per_suite_md,
                                         served_split, served_split_md, summarize)


class FakeApp:
    """A served app as ``round_robin`` sees it: ``frozen`` is its state now."""

    def __init__(self, name: str) -> None:
        self.name, self.frozen = name, False

    def freeze(self, frozen: bool) -> None:
        self.frozen = frozen


def test_round_robin_leaves_running_only_the_app_named_for_the_runner():
    plain, default = FakeApp("plain"), FakeApp("default")
    every = (plain, default)
    seen: dict[str, list[tuple[str, ...]]] = {}

    def runner(name):
        def run(batch):
            seen.setdefault(name, []).append(tuple(a.name for a in every if not a.frozen))
            return [{"prompt_id": p.prompt_id, "suite": p.suite, "wall_s": 0.01, "tokens": 1, "text": "x",
                     "metrics": {}} for p in batch]
        return run

    names = ["in_process/plain/1", f"{BESIDE}/plain/1", f"{BESIDE}/default/1", "served/plain/1", "served/default/1"]
    apps = {"served/plain/1": plain, "served/default/1": default, f"{BESIDE}/plain/1": plain,
            f"{BESIDE}/default/1": plain}  # two names share the plain app: it must stay running for both
    prompts = [Prompt("caption", f"caption-{i}", [], None) for i in range(3)]
    sets = round_robin({n: runner(n) for n in names}, prompts, 1, apps)
    assert set(seen["in_process/plain/1"]) == {()}  # alone: every app frozen
    assert set(seen[f"{BESIDE}/plain/1"]) == {("plain",)} and set(seen[f"{BESIDE}/default/1"]) == {("plain",)}
    assert set(seen["served/plain/1"]) == {("plain",)} and set(seen["served/default/1"]) == {("default",)}
    assert not plain.frozen and not default.frozen  # all resumed at the end
    assert all(len(s["rows"]) == 3 for s in sets.values())


def _row(tokens_per_s: float, outside: float | None = 1.0) -> dict:
    return {"tokens_per_s": tokens_per_s, "outside_engine_ms": outside}


def test_served_split_parts_ray_background_from_the_request_path():
    rows = {"in_process/plain/1": _row(200.0, 0.2), f"{BESIDE}/plain/1": _row(190.0),
            "served/plain/1": _row(171.0, 9.5),
            "in_process/default/1": _row(600.0, 0.3), f"{BESIDE}/default/1": _row(540.0),
            "served/default/1": _row(486.0, 8.0), "served/plain/8": _row(300.0, None)}
    split = {x["config"]: x for x in served_split(rows)}
    assert split["plain"]["background"] == pytest.approx(0.95) and split["plain"]["path"] == pytest.approx(0.9)
    assert split["default"]["background"] == pytest.approx(0.9) and split["default"]["path"] == pytest.approx(0.9)
    assert split["default"]["served_vs_in_process"] == pytest.approx(0.81)
    assert (split["plain"]["outside_ms_in_process"], split["plain"]["outside_ms_served"]) == (0.2, 9.5)
    md = "\n".join(served_split_md(rows))
    assert "| plain | 200.0 | 190.0 | 171.0 | 0.950 | 0.900 | 0.855 | 0.2 / 9.5 |" in md
    assert served_split({k: v for k, v in rows.items() if not k.startswith(BESIDE)}) == []  # --no-beside-ray
    assert served_split_md({}) == []


def test_summarize_books_time_outside_the_engine_per_request_at_one_stream_only():
    def raw(wall, booked):
        return {"prompt_id": "p", "suite": "caption", "wall_s": wall, "tokens": 10, "text": "x",
                "metrics": {"time_s": {"prefill": booked / 2, "verify": booked / 2}, "blocks": 0}}

    sets = {"served/plain/1": {"wall_s": 0.3, "rows": [raw(0.1, 0.09), raw(0.2, 0.18)]},
            "served/plain/8": {"wall_s": 0.2, "rows": [raw(0.2, 0.05), raw(0.2, 0.05)]}}
    rows = summarize(sets, sets["served/plain/1"])
    assert rows["served/plain/1"]["outside_engine_ms"] == pytest.approx(15.0)  # (10 + 20) / 2 ms
    assert rows["served/plain/8"]["outside_engine_ms"] is None  # a batch's wall time is not one request's


def test_served_over_in_process_per_suite_reads_the_first_goal_on_captions():
    rows = {"in_process/plain/1": {"per_suite_tokens_per_s": {"caption": 100.0, "vqa": 30.0}},
            "served/plain/1": {"per_suite_tokens_per_s": {"caption": 93.0, "vqa": 24.0}},
            "in_process/default/1": {"per_suite_tokens_per_s": {"caption": 300.0}},
            "served/default/1": {"per_suite_tokens_per_s": {"caption": 270.0, "vqa": 25.0}},
            "served/plain/8": {"per_suite_tokens_per_s": {"caption": 500.0, "vqa": 90.0}}}
    table = dict(served_per_suite(rows, ["caption", "vqa"]))
    assert table["plain"] == [pytest.approx(0.93), pytest.approx(0.8)]
    assert table["default"] == [pytest.approx(0.9), None]  # no in-process vqa figure: no ratio
    md = "\n".join(served_per_suite_md(rows, ["caption", "vqa"]))
    assert "| plain | 0.930 | 0.800 |" in md and "| default | 0.900 |  |" in md
    assert served_per_suite_md({"served/plain/8": rows["served/plain/8"]}, ["caption"]) == []
