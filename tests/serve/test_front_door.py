"""``specula serve MODEL_DIR --drafter KIND|DIR --gamma N --speculative-config JSON`` (runtime/config_front_door.py):
the flags become config fields before validation, a drafter directory's record names its kind, and a record whose
``target_sha256`` names other weights than the served model's is refused at start-up with both named. A real
``specula serve`` subprocess with a drafter directory answers the ``openai`` client with plain decoding's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from specula.runtime.config import ConfigError, load_config
from specula.runtime.config_front_door import apply_flags
from specula.zoo.store import weights_fingerprint

from ray_kit import RAY_ENV, free_port, ray_env, wait_for
from serve_kit import make_config


def _text_lm_dir(model_dir, out, sha: str | None):
    """The target's own LM as a text_lm drafter directory, its record naming ``sha`` as its target."""
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(model_dir)
    lm = LlamaForCausalLM(hf.config.text_config)
    lm.model.load_state_dict(hf.model.language_model.state_dict())
    lm.tie_weights()
    lm.eval().save_pretrained(out)
    rec = {"kind": "text_lm", "image_token_id": hf.config.image_token_id}
    if sha:
        rec["target_sha256"] = sha
    (out / "specula.json").write_text(json.dumps(rec))
    return out


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tmp_path_factory):
    return _text_lm_dir(model_dir, tmp_path_factory.mktemp("text_lm_for_model"), weights_fingerprint(model_dir))


def test_flags_become_config_fields(model_dir, drafter_dir):
    cfg = load_config(apply_flags({}, str(model_dir), str(drafter_dir), 3))
    assert cfg.model.path == str(model_dir) and cfg.drafter.kind == "text_lm" and cfg.drafter.gamma == 3
    assert cfg.drafter.options == {"path": str(drafter_dir)}
    spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 5, "overlap": false}' % drafter_dir
    cfg = load_config(apply_flags({"drafter": {"kind": "ngram", "options": {"max_n": 4}}}, str(model_dir),
                                  speculative=spec))
    assert (cfg.drafter.kind, cfg.drafter.gamma, cfg.drafter.overlap) == ("text_lm", 5, False)
    assert cfg.drafter.options == {"path": str(drafter_dir)}  # the old kind's options went with it
    cfg = load_config(apply_flags({}, speculative={"method": "ngram", "prompt_lookup_max": 5}))
    assert cfg.drafter.kind == "ngram" and cfg.drafter.options == {"max_n": 5}
    cfg = load_config(apply_flags({}, drafter="flash"))  # a shipped drafter on the shipped target
    assert cfg.drafter.kind == "flash" and cfg.drafter.options == {"path": "flash"}


@pytest.mark.parametrize("flags, match", [
    ({"drafter": "nonesuch"}, "neither a drafter directory"),
    ({"speculative": '{"method": "ngram", "colour": 1}'}, "unknown key"),
    ({"speculative": "{not json"}, "not valid JSON"),
    ({"speculative": '{"method": "eagle", "model": "flash"}'}, "is a 'flash' drafter"),
    ({"speculative": '{"method": "ngram"}', "drafter": "ngram"}, "give one"),
])
def test_bad_flags_are_refused_with_a_message(flags, match):
    with pytest.raises(ConfigError, match=match):
        load_config(apply_flags({}, **flags))


def test_a_drafter_trained_for_other_weights_is_refused_naming_both(model_dir, tmp_path):
    other = _text_lm_dir(model_dir, tmp_path / "for_another", "f" * 64)
    with pytest.raises(ConfigError) as e:
        load_config(apply_flags({}, str(model_dir), str(other)))
    msg = str(e.value)
    assert "ffffffffffffffff" in msg and weights_fingerprint(model_dir)[:16] in msg and str(model_dir) in msg
    assert "specula train text_lm --target" in msg
    with pytest.raises(ConfigError, match="trained for target weights"):  # a shipped drafter on a user's model
        load_config(apply_flags({}, str(model_dir), "eagle"))
    with pytest.raises(ConfigError, match="is a 'text_lm' drafter, configured as kind 'eagle'"):
        load_config({"model": {"path": str(model_dir)}, "drafter": {"kind": "eagle", "options": {"path": str(other)}}})


def test_help_explains_the_flags():
    out = subprocess.run([sys.executable, "-m", "specula.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for flag in ("MODEL_DIR", "--drafter KIND|DIR", "--gamma N", "--speculative-config JSON", "--config"):
        assert flag in out


@pytest.mark.integration
@pytest.mark.slow
def test_serve_model_dir_with_a_drafter_dir_answers_the_openai_client(model_dir, drafter_dir, processor, tmp_path):
    openai = pytest.importorskip("openai")
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import GenerationRequest, SpecEngine
    from specula.targets import load_target

    port = free_port()
    base = make_config("target", http={"host": "127.0.0.1", "port": port}).model_dump(mode="json")
    del base["model"], base["drafter"]  # from the command line
    cfg_file = tmp_path / "ports.yaml"
    cfg_file.write_text(yaml.safe_dump(base))
    question = "What colour is the star?"
    messages = [{"role": "user", "content": [{"type": "text", "text": question}]}]
    ids = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
    ids = ids["input_ids"][0] if hasattr(ids, "keys") else ids[0]
    plain = SpecEngine(load_target(model_dir), None, eos_token_ids=[processor.tokenizer.eos_token_id]).generate(
        [GenerationRequest("p", ids, None, SamplingParams(max_tokens=16))])["p"]
    out = tmp_path / "serve.log"
    with ray_env() as tmp, open(out, "wb") as sink:
        env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "specula.cli", "serve", str(model_dir), "--drafter", str(drafter_dir),
               "--gamma", "3", "--config", str(cfg_file), "--num-cpus", "2", "--ray-temp-dir", tmp]
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError(f"specula serve exited with {proc.returncode}:\n{out.read_text()}")
                return "specula: serving" in out.read_text()

            wait_for("specula serve ready", ready, 180, every=1.0)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    assert "drafter text_lm" in out.read_text()
    assert chat.choices[0].message.content == processor.tokenizer.decode(plain.tokens, skip_special_tokens=True)
    extra = chat.model_extra["specula"]  # Specula's extension of the response: the drafter really drafted
    assert extra["drafter"] == "ok" and extra["metrics"]["draft_tokens"] > 0


def test_model_dir_is_applied_before_the_config_file_is_checked(model_dir, drafter_dir, tmp_path):
    """``specula serve MODEL_DIR --config f.yaml``: a drafter record in the file (here an alternative trained for
    MODEL_DIR) is checked against MODEL_DIR, not against the model the file alone would name (the embedded
    target); and a file that is not a mapping where one is needed is one ConfigError naming the file."""
    import argparse

    import yaml

    from specula.runtime.config import ConfigError
    from specula.runtime.serve.launch import add_serve_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    f = tmp_path / "serve.yaml"
    f.write_text(yaml.safe_dump({"drafter": {"alternatives": {"mine": {"kind": "text_lm",
                                                                        "options": {"path": str(drafter_dir)}}}}}))
    cfg = config_from_args(p.parse_args([str(model_dir), "--drafter", "ngram", "--config", str(f), "--port", "0"]))
    assert cfg.model.path == str(model_dir) and cfg.drafter.kind == "ngram" and cfg.http.port == 0
    assert cfg.drafter.alternatives["mine"].options == {"path": str(drafter_dir)}
    with pytest.raises(ConfigError, match="trained for"):  # the same file alone names the embedded target
        config_from_args(p.parse_args(["--config", str(f)]))
    f.write_text(yaml.safe_dump({"model": "not a mapping"}))
    with pytest.raises(ConfigError, match=f"{f}: model: must be a mapping"):
        config_from_args(p.parse_args([str(model_dir), "--config", str(f)]))


def test_the_served_drafter_is_checked_against_the_models_tokenizer(model_dir, tmp_path):
    """A text_lm directory whose saved tokenizer maps a token to another id than the served model's: the serving
    factory hands the drafter the model's own tokenizer, so it is refused naming the token (the record's
    fingerprint matches: only the token-by-token comparison can catch it). The same LM with the model's own
    tokenizer beside it loads."""
    from transformers import AutoTokenizer

    from specula.runtime.engine.factory import make_drafter, target_facts, target_tokenizer

    tok = target_tokenizer(load_config(apply_flags({}, str(model_dir))))
    assert tok is not None and len(tok) == len(AutoTokenizer.from_pretrained(model_dir))
    for name, swap in (("same", False), ("swapped", True)):
        d = _text_lm_dir(model_dir, tmp_path / name, weights_fingerprint(model_dir))
        tok.save_pretrained(d)
        if swap:
            j = json.loads((d / "tokenizer.json").read_text())
            v = j["model"]["vocab"]
            a, b = sorted(k for k in v if len(k) == 1 and k.isalpha())[:2]
            v[a], v[b] = v[b], v[a]
            (d / "tokenizer.json").write_text(json.dumps(j))
        cfg = load_config(apply_flags({}, str(model_dir), str(d)))
        if swap:
            with pytest.raises(ValueError, match="in the drafter's tokenizer but"):
                make_drafter(cfg)
        else:
            assert make_drafter(cfg).vocab_size == target_facts(cfg)["vocab_size"]
