"""`specula bench report` on a tiny random LLaVA: every section has numbers or says why not, the markdown has the
tables, the PNGs are real images, every seed paper has a claim line, greedy speculative outputs equal plain decoding;
and the claim rules give the verdict the numbers call for."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from specula.runtime.bench.report.run import ReportConfig, run, write_report
from specula.runtime.bench.report import claims
from specula.runtime.bench.report.args import SECTION_NAMES
from specula.targets import packed_linear


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny random LLaVA checkpoint, and its language model alone as a text-only drafter (so HF assisted runs)."""
    from transformers import LlamaForCausalLM

    from specula.targets.processor import load_processor
    from specula.zoo.store import TOKENIZER_DIR
    from specula.targets.embedded_arch import TargetArch, build_model

    root = tmp_path_factory.mktemp("report_models")
    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    model.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.tie_weights()
    lm.save_pretrained(root / "text_lm")
    return root


@pytest.fixture(scope="module")
def report(model_dirs, tmp_path_factory):
    cfg = ReportConfig(
        model=str(model_dirs / "target"),
        drafters=({"kind": "ngram"}, {"kind": "random", "peaked": 2.0},
                  {"kind": "random", "structure": "tree", "peaked": 2.0},
                  {"kind": "text_lm", "path": str(model_dirs / "text_lm")}, {"kind": "no_such_drafter"}),
        suites=("vqa", "text"), n_per_suite=1, max_tokens=6, gammas=(2, 3), gamma_suites=("vqa",), gamma_n=1,
        temperature_suites=("vqa",), temperature_n=1, image_counts=(1, 2), images_n=1, streams=(1, 2),
        hf_suites=("vqa",), hf_n=1, target_max_gamma=3, target_repeats=2, codecs=("fp32", "int8+zstd"),
        wire_repeats=1, overlap_suites=("vqa",), overlap_n=1, served_suites=("vqa", "text"), served_n=1,
        served_streams=(1,))
    r = run(cfg, log=lambda *_: None)
    out = write_report(r, tmp_path_factory.mktemp("report"))
    return r, out


def test_every_section_has_numbers_or_a_reason(report):
    r, _ = report
    assert set(r["sections"]) == set(SECTION_NAMES)
    for name, sec in r["sections"].items():
        assert sec["status"] in ("ok", "not_measured", "failed"), name
        if sec["status"] != "ok":
            assert sec["reason"], name
    ok = {n for n, s in r["sections"].items() if s["status"] == "ok"}
    assert ok == set(SECTION_NAMES), {n: s.get("reason") for n, s in r["sections"].items()}


def test_main_table_is_drafter_by_suite_and_greedy_is_exact(report):
    r, _ = report
    main = r["sections"]["main"]
    assert set(main["configs"]) == {"plain", "ngram", "random", "random/tree", "text_lm"}
    for name, c in main["configs"].items():
        for suite in ("vqa", "text"):
            cell = c["groups"][suite]
            assert cell["tau"] >= 1.0 and cell["speedup_vs_plain"] > 0 and cell["tokens"] > 0
        if name != "plain":
            assert c["all"]["exact"] is True, name  # token for token equal to plain decoding
            assert len(c["all"]["alpha"]) >= 1
            assert set(c["all"]["time_split_s"]) == {"draft", "verify", "other"}
    assert main["greedy_exact"] is True
    # the text-only copy of the target's LM drafts the target's own tokens on a text prompt: accepted
    assert main["configs"]["text_lm"]["groups"]["text"]["tau"] > 1.0
    assert main["best"] in main["configs"]


def test_sections_measure_what_they_say(report):
    r, _ = report
    S = r["sections"]
    assert set(S["gamma"]["drafters"]["ngram"]) == {"2", "3"}
    t = S["temperature"]["by_temperature"]
    assert t["1"]["plain"]["speedup_vs_plain"] == 1.0 and t["1"]["text_lm"]["tau"] >= 1.0 and t["0"]
    assert set(S["multi_image"]["configs"]["random"]["groups"]) == {"k=1", "k=2"}
    assert S["multi_image"]["prompt_tokens"]["k=2"] > S["multi_image"]["prompt_tokens"]["k=1"]
    conc = S["concurrency"]["configs"]
    assert set(conc) == {"plain", S["main"]["best"]} and set(conc["plain"]) == {"1", "2"}
    assert all(v["tokens_per_s"] > 0 for c in conc.values() for v in c.values())
    hf = S["hf"]["configs"]
    assert {"plain", "hf", "hf_assisted"} <= set(hf), S["hf"]
    assert S["hf"]["hf_assisted"] == "measured" and hf["plain"]["speedup_vs_hf_generate"] > 0
    assert [v["gamma"] for v in S["target"]["verify"]] == [1, 2, 3] and S["target"]["decode_ms"] > 0
    assert set(S["wire"]["codecs"]) == {"fp32", "int8+zstd"}
    for by_shape in S["wire"]["codecs"].values():
        assert all(v["wire_bytes"] > 0 for v in by_shape.values())
    ov = S["overlap"]  # verifier here, the drafter in a child process over loopback gRPC
    assert set(ov["configs"]) == {"plain", "single_process", "sequential", "pipelined", "predraft", "offers"}
    assert ov["configs"]["pipelined"]["greedy_exact"] is True and ov["overlap"]["efficiency"] > 0
    assert ov["drafter"]["kind"] == "text_lm"  # never ngram / random: their drafting leaves nothing to overlap
    assert all(ov["configs"][n]["critical_draft_vs_t_decode"] > 0 for n in ("single_process", "offers"))
    sv = S["served"]  # specula serve (default config, and gamma 0) over HTTP beside in-process decoding
    # in process also beside the idle plain app's Ray (parts Ray's background from the served request path)
    assert set(sv["rows"]) == {f"{rt}/{c}/1" for rt in ("in_process", "served", "beside_ray")
                               for c in ("plain", "default")}
    assert all(row["exact"] and row["tokens_per_s"] > 0 for row in sv["rows"].values()), sv["rows"]
    assert sv["drafter"]["kind"] == "ngram"  # the default on a model flash was not trained for
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["torch"] and r["machine"]["torch_threads"] == 1


def test_missing_drafters_are_listed_with_reasons(report):
    r, _ = report
    missing = {m["label"]: m["reason"] for m in r["drafters"]["missing"]}
    assert "unknown drafter kind" in missing["no_such_drafter"]
    assert "msd" in missing and "ensemble" in missing  # not requested: said so, and the claims say why


def test_markdown_tables_plots_and_claim_lines(report):
    r, out = report
    md = (out / "report.md").read_text()
    for heading in ("## Machine", "## Drafters", "## Seed papers' claims", "tau and speedup per drafter x suite",
                    "gamma sweep", "temperature 0 and 1", "multi-image scaling", "throughput vs concurrency",
                    "HF generate and HF assisted", "T_verify(gamma) / T_decode", "wire bytes per codec",
                    "overlap efficiency", "### alpha_n", "### time split"):
        assert heading in md, heading
    assert "| config | vqa | text | visual | all |" in md
    # the HF rows run stock kernels, ours the packed linears: said beside the table
    assert (r["sections"]["hf"]["packed_linears"] > 0) == ("packed for oneDNN" in md) == packed_linear.available()
    sv = r["sections"]["served"]["rows"]  # the served section's per-suite table: default over plain, same runtime
    ratio = [sv["served/default/1"]["per_suite_tokens_per_s"][s] / sv["served/plain/1"]["per_suite_tokens_per_s"][s]
             for s in ("vqa", "text")]
    assert "| runtime | config | streams | vqa | text |" in md
    assert f"| served | default | 1 | {ratio[0]:.2f}x | {ratio[1]:.2f}x |" in md
    main = r["sections"]["main"]["configs"]  # each drafter's draft time per block against this run's T_decode
    t_decode = 1000 * main["plain"]["all"]["time_split_s"]["verify"] / main["plain"]["all"]["blocks"]
    lm = main["text_lm"]["all"]["draft_ms_per_block"]
    assert f"({t_decode:.2f} ms)" in md and f"| {lm:.3f} | {lm / t_decode:.2f} |" in md
    bg = sv["beside_ray/plain/1"]["tokens_per_s"] / sv["in_process/plain/1"]["tokens_per_s"]  # Ray's background
    assert f"| plain | {sv['in_process/plain/1']['tokens_per_s']} |" in md and f"| {bg:.3f} |" in md
    for paper in ("msd", "flash", "aasd", "massv", "ibed"):
        assert f"- **{paper}** (" in md
    assert [c["paper"] for c in r["claims"]] == ["msd", "flash", "aasd", "massv", "ibed"]
    assert all(c["verdict"] in (claims.REPRODUCED, claims.NOT_REPRODUCED, claims.NOT_MEASURABLE) for c in r["claims"])
    expected = {"tau_per_suite.png", "speedup_per_suite.png", "alpha_n.png", "time_split.png", "gamma_speedup.png",
                "gamma_tau.png", "temperature.png", "multi_image_tau.png", "concurrency.png", "hf_comparison.png",
                "verify_ratio.png", "wire_bytes.png"}
    assert set(r["plots"]) == expected and not r["plot_errors"]
    for name in expected:
        with Image.open(out / name) as im:
            im.verify()
        assert f"]({name})" in md
    saved = json.loads((out / "report.json").read_text())
    assert saved["claims"] == r["claims"]
    assert saved["sections"]["main"]["configs"].keys() == r["sections"]["main"]["configs"].keys()


def test_a_failing_section_is_recorded_not_fatal(model_dirs):
    cfg = ReportConfig(model=str(model_dirs / "target"), drafters=({"kind": "ngram"},), suites=("text",),
                       n_per_suite=1, max_tokens=3, codecs=("no_such_codec",),
                       skip=("temperature", "gamma", "multi_image", "concurrency", "hf", "target", "overlap",
                             "served"))
    r = run(cfg, log=lambda *_: None)
    assert r["sections"]["wire"]["status"] == "failed" and "no_such_codec" in r["sections"]["wire"]["reason"]
    assert r["sections"]["main"]["status"] == "ok"
    assert r["sections"]["hf"] == {"status": "not_measured", "reason": "skipped (--skip)"}


def test_bad_config_is_a_clear_error(model_dirs, capsys):
    from specula.cli import main

    assert main(["bench", "report", "--model", str(model_dirs / "target"), "--suite", "nope", "--out", "/tmp/x"]) == 2
    assert "unknown suite" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- claim rules


def _fake(taus: dict[str, float], speedups: dict[str, float] | None = None, draft_ms: dict | None = None,
          multi: dict | None = None) -> dict:
    """A report JSON with just what the claim rules read."""
    speedups, draft_ms = speedups or {}, draft_ms or {}
    configs = {k: {"visual": {"tau": t, "speedup_vs_plain": speedups.get(k, 1.0),
                              "draft_ms_per_block": draft_ms.get(k, 1.0)}, "all": {}} for k, t in taus.items()}
    sec = {"main": {"status": "ok", "configs": configs}}
    if multi is not None:
        sec["multi_image"] = {"status": "ok", "configs": {k: {"groups": {f"k={n}": {"tau": t} for n, t in v.items()}}
                                                        for k, v in multi.items()}}
    return {"drafters": {"available": [{"label": k, "kind": k.split("/")[0]} for k in taus],
                         "missing": [{"label": "flash", "reason": "weights not shipped: zoo/weights/flash"}]},
            "sections": sec}


def _verdicts(r):
    return {c["paper"]: c["verdict"] for c in claims.evaluate(r)}


def test_claim_rules_follow_the_numbers():
    good = _fake({"msd": 3.0, "eagle/tree": 2.5, "eagle": 2.0, "aasd": 2.4, "text_lm": 1.8, "massv": 2.4,
                  "ensemble": 2.5, "pooled": 2.0},
                 speedups={"aasd": 1.5, "text_lm": 1.2}, multi={"ensemble": {1: 2.5, 5: 2.4}})
    v = _verdicts(good)
    assert v == {"msd": "reproduced", "flash": "not measurable yet", "aasd": "reproduced", "massv": "reproduced",
                 "ibed": "reproduced"}
    flash = next(c for c in claims.evaluate(good) if c["paper"] == "flash")
    assert "weights not shipped" in flash["evidence"]
    bad = _fake({"msd": 2.0, "eagle": 2.5, "aasd": 2.0, "text_lm": 1.8, "massv": 2.0, "ensemble": 2.5, "flash": 2.4},
                speedups={"aasd": 1.0, "text_lm": 1.2}, draft_ms={"flash": 1.5, "eagle": 1.0},
                multi={"ensemble": {1: 2.5, 5: 1.5}})
    assert _verdicts(bad) == {"msd": "not reproduced", "flash": "not reproduced", "aasd": "not reproduced",
                              "massv": "not reproduced", "ibed": "not reproduced"}
    cheap = _fake({"flash": 2.3, "eagle": 2.5}, draft_ms={"flash": 0.5, "eagle": 1.0})  # 2.3 >= 0.9 x 2.5
    assert _verdicts(cheap)["flash"] == "reproduced"
    # flash (a chain) against eagle's chain, not its tree (more nodes per block, higher tau)
    both = _fake({"flash": 2.3, "eagle": 2.5, "eagle/tree": 3.5},
                 draft_ms={"flash": 0.5, "eagle": 1.0, "eagle/tree": 2.0})
    assert _verdicts(both)["flash"] == "reproduced"
    assert "eagle: 1.0 ms/block" in next(c for c in claims.evaluate(both) if c["paper"] == "flash")["evidence"]
    slow = _fake({"flash": 2.3, "eagle": 2.5, "eagle/tree": 3.5}, draft_ms={"flash": 1.5, "eagle": 1.0})
    assert _verdicts(slow)["flash"] == "not reproduced"
    # a speedup rule compares each kind at its fastest: text_lm's chain here, not its higher-tau but slower tree
    tree_slower = _fake({"aasd": 2.2, "text_lm": 2.6, "text_lm/tree": 2.7},
                        speedups={"aasd": 0.973, "text_lm": 0.974, "text_lm/tree": 0.913})
    assert _verdicts(tree_slower)["aasd"] == "not reproduced"
    assert "text_lm speedup 0.974x" in next(c for c in claims.evaluate(tree_slower) if c["paper"] == "aasd")["evidence"]
    no_five = _fake({"ensemble": 3.0, "massv": 2.0}, multi={"ensemble": {1: 3.0}})
    assert _verdicts(no_five)["ibed"] == "not measurable yet"
    # with the paper's at-once ensemble measured, the claim is judged on it, not on the default on-demand one
    both = _fake({"ensemble": 3.0, "ensemble/at_once": 2.5, "massv": 3.0},
                 multi={"ensemble": {1: 3.0, 5: 3.0}, "ensemble/at_once": {1: 2.5, 5: 2.5}})
    both["drafters"]["available"][1]["config"] = {"kind": "ensemble", "join": "at_once"}
    assert _verdicts(both)["ibed"] == "not reproduced"
    assert "ensemble/at_once tau 2.5" in next(c for c in claims.evaluate(both) if c["paper"] == "ibed")["evidence"]
    del both["drafters"]["available"][1]["config"]  # a report of an older checkout: the best ensemble, as before
    assert _verdicts(both)["ibed"] == "reproduced"


def test_help_names_the_flags(capsys):
    from specula.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "report", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--quick", "--model", "--drafters", "--out", "--skip"):
        assert flag in out


def test_quick_keeps_one_variant_per_kind_after_the_main_table(model_dirs):
    cfg = ReportConfig(model=str(model_dirs / "target"), drafters=({"kind": "random"}, {"kind": "random",
                       "structure": "tree"}), suites=("text",), n_per_suite=1, max_tokens=3, every_variant=False,
                       temperature_suites=("text",), temperature_n=1,
                       skip=("gamma", "multi_image", "concurrency", "hf", "target", "wire", "overlap", "served"))
    r = run(cfg, log=lambda *_: None)
    main = r["sections"]["main"]["configs"]
    faster = max(("random", "random/tree"), key=lambda n: main[n]["all"]["speedup_vs_plain"])
    assert set(r["sections"]["temperature"]["by_temperature"]["1"]) == {"plain", faster}


def test_quick_flag_selects_the_quick_preset(model_dirs):
    from specula.cli import build_parser
    from specula.runtime.bench.report.run import QUICK, config_from_args

    args = build_parser().parse_args(["bench", "report", "--quick", "--model", str(model_dirs / "target"),
                                      "--drafters", "ngram", '{"kind": "random", "peaked": 1.0}', "--n", "2"])
    cfg = config_from_args(args)
    assert cfg.quick and cfg.n_per_suite == 2 and cfg.image_counts == QUICK["image_counts"]
    assert cfg.drafters == ({"kind": "ngram"}, {"kind": "random", "peaked": 1.0})


# ------------------------------------------------------------------------------------ reliability figures

RELIABILITY_KIT = Path(__file__).parent / "reliability" / "reliability_kit.py"


def _kit():
    """tests/reliability/reliability_kit.py, loaded by path (that folder is not a package)."""
    spec = importlib.util.spec_from_file_location("reliability_kit_under_test", RELIABILITY_KIT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_record_figure_prints_and_appends_one_json_line(tmp_path, monkeypatch, capsys):
    kit = _kit()
    monkeypatch.delenv(kit.FIGURES_ENV, raising=False)
    kit.record_figure("test_a", "3/3 refused", refused=3)  # no file named: printed only
    assert capsys.readouterr().out == "\n3/3 refused\n"
    out = tmp_path / "not" / "yet" / "figures.jsonl"
    monkeypatch.setenv(kit.FIGURES_ENV, str(out))
    kit.record_figure("test_a", "3/3 refused", refused=3, statuses={"HTTP 400": 3})
    kit.record_figure("test_b", "RSS +1.5 MiB", rss_growth_mib=1.5, kv=torch.tensor(7))
    assert capsys.readouterr().out == "\n3/3 refused\n\nRSS +1.5 MiB\n"
    lines = out.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"test": "test_a", "line": "3/3 refused", "numbers": {"refused": 3, "statuses": {"HTTP 400": 3}}},
        {"test": "test_b", "line": "RSS +1.5 MiB", "numbers": {"rss_growth_mib": 1.5, "kv": 7}}]


TINY_SUITE = {  # a checkout in miniature: the real reliability_kit, tests that pass, fail and hang
    "tests/reliability/test_ok.py": '''
from reliability_kit import record_figure

def test_counts():
    record_figure("test_counts", "3/3 widgets refused | none crashed", refused=3, total=3)

def test_noise():
    record_figure("test_noise", "noise refused: 7", refused=7)
''',
    "tests/reliability/test_bad.py": '''
from reliability_kit import record_figure

def test_breaks():
    record_figure("test_breaks", "1/2 rejected", rejected=1, total=2)
    assert 1 == 2, "one got through"

def test_dies_before_its_figure():
    raise RuntimeError("no figure from me")
''',
    "tests/hang/test_hang.py": '''
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
from reliability_kit import record_figure

def test_hangs():
    record_figure("test_hangs", "started", pid=os.getpid())
    time.sleep(600)
''',
}


@pytest.fixture(scope="module")
def tiny_checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkout")
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = \"-ra\"\n")
    for rel, text in TINY_SUITE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    shutil.copy(RELIABILITY_KIT, root / "tests" / "reliability" / "reliability_kit.py")
    return root


def test_reliability_suite_figures_and_outcomes(tiny_checkout, tmp_path):
    from specula.runtime.bench.report.reliability import run_suite

    sec = run_suite(tiny_checkout, ("tests/reliability/test_ok.py", "tests/gone.py"), tmp_path, timeout_s=300)
    assert sec["status"] == "ok" and sec["exit_code"] == 0, sec
    assert sec["counts"] == {"passed": 2, "failed": 0, "error": 0, "skipped": 0}
    assert sec["missing_tests"] == ["tests/gone.py"] and "tests/gone.py" in sec["note"]
    assert {f["test"]: f["numbers"] for f in sec["figures"]} == {"test_counts": {"refused": 3, "total": 3},
                                                                "test_noise": {"refused": 7}}
    assert {r["test"]: (r["outcome"], r["figures"]) for r in sec["results"]} == {
        "test_counts": ("passed", ["3/3 widgets refused | none crashed"]),
        "test_noise": ("passed", ["noise refused: 7"])}
    assert (tmp_path / sec["files"]["figures"]).is_file() and (tmp_path / sec["files"]["junit"]).is_file()

    failing = run_suite(tiny_checkout, ("tests/reliability",), tmp_path / "again", timeout_s=300)
    assert failing["status"] == "failed" and failing["exit_code"] == 1, failing
    assert failing["reason"] == "pytest exit code 1: 2 failed of 4 test(s)"
    outcome = {r["test"]: (r["outcome"], r["figures"]) for r in failing["results"]}
    assert outcome["test_breaks"] == ("failed", ["1/2 rejected"])  # a figure printed before the failing assert
    assert outcome["test_dies_before_its_figure"] == ("failed", [])
    assert outcome["test_counts"][0] == "passed"
    assert any("one got through" in line for line in failing["tail"])

    gone = run_suite(tiny_checkout / "nowhere", ("tests/reliability",), tmp_path)
    assert gone["status"] == "not_measured" and gone["reason"].startswith("tests not found")


def test_reliability_suite_timeout_kills_pytest_and_keeps_the_figures(tiny_checkout, tmp_path):
    from specula.runtime.bench.report.reliability import run_suite

    sec = run_suite(tiny_checkout, ("tests/hang",), tmp_path, timeout_s=15)
    assert sec["status"] == "failed" and sec["reason"].startswith("timed out after 15 s"), sec
    assert sec["exit_code"] is None and sec["results"][0]["outcome"] is None  # no junit from a killed pytest
    [fig] = sec["figures"]
    assert fig["line"] == "started"
    with pytest.raises(ProcessLookupError):  # the test's process (pytest itself) is gone
        os.kill(fig["numbers"]["pid"], 0)


def test_reliability_section_in_the_report_json_and_markdown(model_dirs, tiny_checkout, tmp_path, monkeypatch):
    from specula.runtime.bench.report import reliability

    monkeypatch.setattr(reliability, "repo_root", lambda: tiny_checkout)
    cfg = ReportConfig(model=str(model_dirs / "target"), drafters=({"kind": "ngram"},), reliability=True,
                       reliability_tests=("tests/reliability",), reliability_timeout_s=300, skip=SECTION_NAMES)
    r = run(cfg, log=lambda *_: None, out=tmp_path)
    out = write_report(r, tmp_path)
    sec = json.loads((out / "report.json").read_text())["sections"]["reliability"]
    assert sec["status"] == "failed" and "2 failed of 4" in sec["reason"]  # recorded, the report still written
    assert {f["line"] for f in sec["figures"]} == {"3/3 widgets refused | none crashed", "noise refused: 7",
                                                   "1/2 rejected"}
    assert (tmp_path / "reliability" / "figures.jsonl").is_file()
    md = (out / "report.md").read_text()
    assert "reliability and security suite" in md and "2 passed, 2 failed, 0 errors, 0 skipped" in md
    assert "| `test_ok::test_counts` | passed | 3/3 widgets refused \\| none crashed |" in md
    assert "| `test_bad::test_breaks` | failed | 1/2 rejected |" in md
    assert "| `test_bad::test_dies_before_its_figure` | failed | - |" in md
    assert "pytest's last lines:" in md and "one got through" in md


def test_reliability_is_opt_in(report, model_dirs):
    from specula.cli import build_parser
    from specula.runtime.bench.report.run import config_from_args

    r, out = report
    assert "reliability" not in r["sections"] and not r["config"]["reliability"]
    assert "*not run*: `specula bench report --reliability` runs it." in (out / "report.md").read_text()
    args = build_parser().parse_args(["bench", "report", "--model", str(model_dirs / "target"), "--reliability",
                                      "--reliability-timeout", "60"])
    cfg = config_from_args(args)
    assert cfg.reliability and cfg.reliability_timeout_s == 60.0
    assert cfg.reliability_tests[0] == "tests/reliability"


def test_parametrized_cases_own_the_figures_recorded_under_their_full_name():
    from specula.runtime.bench.report.reliability import _results

    cases = [{"test": "test_auth[a]"}, {"test": "test_auth[b]"}, {"test": "test_x[1]"}, {"test": "test_x[2]"}]
    figures = [{"test": "test_auth[a]", "line": "a refused"}, {"test": "test_auth[b]", "line": "b refused"},
               {"test": "test_x", "line": "shared"}, {"test": "test_lost", "line": "timed out"}]
    got = {r["test"]: r["figures"] for r in _results(cases, figures)}
    assert got == {"test_auth[a]": ["a refused"], "test_auth[b]": ["b refused"], "test_x[1]": ["shared"],
                   "test_x[2]": ["shared"], "test_lost": ["timed out"]}


def test_the_paper_s_ensemble_is_measured_beside_the_default_one():
    """The report runs the ensemble as IbED publishes it (every member at once) beside the default (members on
    demand), and keeps both in the sections after the main one (the IbED claim reads the at-once one's multi-image
    run), while other kinds keep only their faster variant."""
    from types import SimpleNamespace

    from specula.runtime.bench.report.drafters import IBED_AS_PUBLISHED, Available, default_configs
    from specula.runtime.bench.report.sections import Ctx

    configs, _ = default_configs()
    assert {"kind": "ensemble"} in configs and IBED_AS_PUBLISHED in configs
    found = SimpleNamespace(available=[Available("ensemble", {"kind": "ensemble"}, None),
                                       Available("ensemble/at_once", dict(IBED_AS_PUBLISHED), None),
                                       Available("massv", {"kind": "massv"}, None),
                                       Available("massv/tree", {"kind": "massv", "structure": "tree"}, None)])
    speed = {"ensemble": 1.3, "ensemble/at_once": 0.9, "massv": 1.28, "massv/tree": 1.07}
    ctx = Ctx(SimpleNamespace(every_variant=False), None, None, None, None, found, [],
              state={"main_configs": {k: {"all": {"speedup_vs_plain": v}} for k, v in speed.items()}})
    assert sorted(a.label for a in ctx.secondary()) == ["ensemble", "ensemble/at_once", "massv"]


def test_the_served_phase_split_counts_the_drafter_s_prefill_as_drafting():
    """Section 10's "prefill / draft / verify": draft is the drafter's whole time per token, its prefill of each
    prompt (booked apart as draft_begin) included, as in section 1's time split."""
    from specula.runtime.bench.report.render import _phases

    assert _phases({"prefill": 5.0, "draft": 0.4, "draft_begin": 0.1, "verify": 2.0, "sample": 0.1}) == \
        "prefill 5.00 / draft 0.50 / verify 2.00"
    assert _phases({"prefill": 5.0, "verify": 2.0}) == "prefill 5.00 / verify 2.00"  # plain decoding drafts nothing
