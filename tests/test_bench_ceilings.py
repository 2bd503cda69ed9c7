"""The ceilings a served run's speedups are read against (``runtime/bench/ceilings.py``), on time splits whose
answers are worked out by hand, and their place in ``bench served``'s markdown and the report's served section."""

from __future__ import annotations

import pytest

from specula.runtime.bench.ceilings import Phases, ceiling, ceilings, ceilings_md, nothing_to_draft


def _row(prefill: float, verify: float, draft: float = 0.0, **more) -> dict:
    return {"ms_per_token": {"prefill": prefill, "verify": verify, "draft": draft, "sample": 0.0, "commit": 0.0,
                             **more}}


def test_phases_split_prefill_from_decoding():
    p = Phases.of({"vision": 1.0, "prefill": 4.0, "draft": 0.5, "draft_begin": 0.25, "caption": 0.25,
                   "verify": 2.0, "sample": 0.5, "commit": 0.5})
    assert p == Phases(5.0, 4.0) and p.total == 9.0
    assert Phases.of({"prefill": 3.0, "verify": None}) == Phases(3.0, 0.0)  # a missing figure counts as nothing


def test_free_decoding_caps_speculation_at_plain_over_the_prefill():
    # plain 5 + 5 ms per token; the default 5 + 2.5: 10 / 7.5 = 1.33x booked, 10 / 5 = 2x with free decoding;
    # 1.5x needs a decode phase of 10 / 1.5 - 5 = 1.67 ms: 5 / 1.67 = 3x plain's
    c = ceiling("in_process", "default over plain", Phases(5.0, 5.0), Phases(5.0, 2.5), 1.5)
    assert c.booked == pytest.approx(4 / 3) and c.cap == pytest.approx(2.0)
    assert c.decode_x == pytest.approx(2.0) and c.needed_decode_x == pytest.approx(3.0)
    # wanting more than free decoding gives: out of reach
    assert ceiling("served", "x", Phases(5.0, 5.0), Phases(5.0, 2.5), 2.0).needed_decode_x is None
    assert ceiling("served", "x", Phases(5.0, 5.0), Phases(0.0, 2.5), 1.5) is None  # no prefill: no bound


def test_ceilings_read_one_stream_over_plain_and_more_streams_over_one():
    rows = {"in_process/plain/1": _row(5.0, 5.0), "in_process/default/1": _row(5.0, 2.0, 0.5),
            "in_process/plain/8": _row(4.0, 2.0), "in_process/default/8": _row(4.0, 1.0),
            "served/plain/1": _row(6.0, 6.0)}  # no served default: nothing to compare there
    cs = ceilings(rows)
    assert [(c.runtime, c.compared) for c in cs] == [("in_process", "default over plain, 1 stream"),
                                                     ("in_process", "default, 8 streams over 1")]
    one, many = cs
    assert one.cap == pytest.approx(2.0) and one.booked == pytest.approx(10 / 7.5)
    # 8 streams: one stream's 7.5 ms per token over the prefill's 4: 1.875x at most; 2.5x needs 3 ms in all,
    # less than the prefill alone: out of reach
    assert many.cap == pytest.approx(7.5 / 4.0) and many.booked == pytest.approx(7.5 / 5.0)
    assert many.decode_x == pytest.approx(2.5) and many.needed_decode_x is None and many.want == 2.5
    assert many.to_dict()["needed_decode_x"] is None and one.to_dict()["cap"] == 2.0


def test_nothing_to_draft_in_suites_of_two_token_answers():
    assert nothing_to_draft({"vqa": 2, "ocr": 1, "caption": 64, "text": 3, "empty": 0}) == ["vqa", "ocr"]
    rows = {"in_process/plain/1": _row(5.0, 5.0), "in_process/default/1": _row(5.0, 2.5)}
    md = "\n".join(ceilings_md(rows, {"vqa": 2, "caption": 64}))
    assert "| in_process | default over plain, 1 stream | 1.33x | 2.00x | 2.00x | 1.5x | 3.00x |" in md
    assert "Nothing to draft in vqa:" in md and "caption" not in md.split("Nothing to draft")[1]
    assert ceilings_md({"in_process/plain/1": _row(5.0, 5.0)}) == []  # nothing measured with speculation


def _served_result(concurrency=(1, 8)) -> dict:
    rows = {}
    for s in concurrency:
        for rt in ("in_process", "served"):
            for cfg, (pre, ver) in (("plain", (5.0, 5.0)), ("default", (5.0, 2.5))):
                rows[f"{rt}/{cfg}/{s}"] = {**_row(pre, ver), "tokens_per_s": 100.0, "speedup_vs_plain": 1.0,
                                           "vs_in_process_plain": 1.0, "tau": 1.0, "exact": True,
                                           "per_suite_tokens_per_s": {"caption": 100.0, "vqa": 10.0},
                                           "per_suite_longest_answer": {"caption": 64, "vqa": 2}}
    return {"drafter": {"kind": "flash"}, "gamma": 8, "model": "m", "machine": {"cpus": 2, "torch": "t"},
            "n_per_suite": 1, "suites": ["caption", "vqa"], "max_tokens": 64, "threads_in_process": 2,
            "concurrency": list(concurrency), "rows": rows}


def test_bench_served_markdown_and_the_report_section_show_the_ceilings():
    from specula.runtime.bench.report.render import _served_md
    from specula.runtime.bench.served import MANY_STREAMS_NOTE, render_markdown

    r = _served_result()
    md = render_markdown(r)
    assert "## Ceilings" in md and "| served | default, 8 streams over 1 |" in md
    assert "Nothing to draft in vqa:" in md and MANY_STREAMS_NOTE in md
    sec = {"drafter": r["drafter"], "gamma": 8, "suites": r["suites"], "n_per_suite": 1, "concurrency": [1, 8],
           "rows": r["rows"]}
    text = "\n".join(_served_md(sec, {}))
    assert "| in_process | default over plain, 1 stream |" in text and "Nothing to draft in vqa:" in text
    assert MANY_STREAMS_NOTE in text
    one = _served_result((1,))
    assert MANY_STREAMS_NOTE not in render_markdown(one)  # one stream: each request's wall time is its own
    assert "default, 8 streams" not in render_markdown(one)
