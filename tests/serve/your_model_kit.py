"""Helpers of tests/serve/test_your_model.py, the path of docs/your-model.md: a user's checkpoint directory and
conversation file -> ``specula train KIND ... --export`` (the real CLI, in-process) -> ``specula serve MODEL_DIR
--drafter DIR`` (a real subprocess on a real local Ray) -> the ``openai`` client; plain decoding's text computed
in-process on the same prompt (runtime/engine/prompts.py, the one prompt path); the exact law of the first tokens
grouped by the text the OpenAI route answers.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ray_kit import RAY_ENV, free_port, ray_env, wait_for
from serve_kit import make_config

# the few-step training every kind gets here: seconds each on one core (what it gives: docs/your-model.md)
FEW_STEPS = ["--samples", "32", "--data-samples", "16", "--max-new-tokens", "8", "--threads", "1"]
# kind -> its own flags on top (a fresh tiny LM where the kind would start from the embedded target's one)
KIND_FLAGS = {"eagle": [], "msd": [], "flash": [], "aasd": [],
              "text_lm": ["--arch", "tiny"],
              "massv": ["--init-lm", "none", "--arch", "tiny", "--pretrain-samples", "16"]}
IMAGE = "images/000.png"  # a picture of the conversation file (tests/user_data.py)
QUESTION_IMAGE, QUESTION_TEXT = "Describe the image.", "What colour is the star? Answer with one word."


@dataclass(frozen=True)
class Trained:
    """One ``specula train KIND`` run: the exported directory, or why there is none."""

    kind: str
    out: Path | None  # the --out directory (specula.json + weights); None when training failed
    error: str  # "" when it trained; else the exit status / exception and the last lines it printed
    seconds: float


def train(kind: str, target: Path, data: Path, root: Path) -> Trained:
    """``specula train KIND --target DIR --data FILE --answers target --run-dir .. --out .. --export`` through
    ``specula.cli.main``, a few steps (``FEW_STEPS``)."""
    from specula.cli import main

    out = root / f"{kind}-out"
    argv = ["train", kind, "--target", str(target), "--data", str(data), "--image-root", str(data.parent),
            "--answers", "target", "--run-dir", str(root / f"{kind}-run"), "--out", str(out), "--export",
            *FEW_STEPS, *KIND_FLAGS[kind]]
    t0 = time.monotonic()
    try:
        rc, error = main(argv), ""
    except Exception as e:  # a trainer's traceback: reported by the test that needs this kind
        rc, error = -1, f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    if rc != 0 and not error:
        error = f"exit status {rc}"
    if rc == 0 and not (out / "specula.json").is_file():
        rc, error = -1, f"exit status 0 but no {out / 'specula.json'}"
    return Trained(kind, out if rc == 0 else None, error, seconds)


def image_messages(data: Path) -> list[dict]:
    """An OpenAI chat message with the file's first picture as a data: URL, then a question."""
    png = base64.b64encode((data.parent / IMAGE).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
                                         {"type": "text", "text": QUESTION_IMAGE}]}]


def text_messages() -> list[dict]:
    return [{"role": "user", "content": QUESTION_TEXT}]


def encoded(model_dir: Path, data: Path, with_image: bool):
    """The prompt of ``image_messages`` / ``text_messages`` as runtime/engine/prompts.py builds it from the
    checkpoint's own processor and chat template (not through the server)."""
    from PIL import Image

    from specula.runtime.engine.prompts import encode_messages
    from specula.targets.processor import load_processor

    processor = load_processor(model_dir)
    if with_image:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION_IMAGE}]}]
        return encode_messages(processor, msgs, [Image.open(data.parent / IMAGE).convert("RGB")])
    return encode_messages(processor, text_messages())


def plain_tokens(model_dir: Path, data: Path, max_tokens: int) -> dict[bool, list[int]]:
    """Plain greedy decoding's tokens (no drafter) for the image and the text-only prompt, in-process."""
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.engine.prompts import eos_ids
    from specula.targets import load_target
    from specula.targets.processor import load_processor

    target = load_target(model_dir)
    engine = SpecEngine(target, None, eos_token_ids=eos_ids(load_processor(model_dir).tokenizer, target))
    out = {}
    for with_image in (True, False):
        req = encoded(model_dir, data, with_image).request("plain", SamplingParams(max_tokens=max_tokens))
        out[with_image] = list(engine.generate([req])["plain"].tokens)
    return out


def generate_chunks(url: str, data: Path, with_image: bool, max_tokens: int, drafter: str | None):
    """The same question through ``POST /generate`` with ``stream: true`` (greedy): the token chunks as the server
    emitted them, and the finished record (metrics, drafter)."""
    from ray_kit import stream_records

    images = [base64.b64encode((data.parent / IMAGE).read_bytes()).decode()] if with_image else []
    body = {"prompt": QUESTION_IMAGE if with_image else QUESTION_TEXT, "images": images,  # images go first
            "max_tokens": max_tokens, "temperature": 0.0, **({"drafter": drafter} if drafter else {})}
    records = list(stream_records(f"{url}/generate", body, timeout=300))
    assert records and records[-1].get("finished"), records[-1:]
    return [r["tokens"] for r in records[:-1] if r.get("tokens")], records[-1]


def served_text(tokenizer, chunks: list[list[int]]) -> str:
    """The text the server's ``Detokenizer`` makes of ``chunks`` (runtime/serve/ingress.py): what every front door
    answers for those tokens emitted in those chunks. Not always ``tokenizer.decode`` of them all: a byte token
    sent as valid text (``<0x75>`` = "u") can be followed by bytes that make HF's byte-fallback decoder replace
    the whole byte run, and text already sent stays (random weights emit such byte runs)."""
    from specula.runtime.serve.ingress import Detokenizer

    detok = Detokenizer(tokenizer)
    for i, c in enumerate(chunks):
        detok.add({"tokens": c, "finished": i == len(chunks) - 1, "finish_reason": "length"})
    return detok.text


@dataclass(frozen=True)
class Served:
    url: str  # http://127.0.0.1:PORT
    log: Path  # what ``specula serve`` printed


@contextlib.contextmanager
def specula_serve(model_dir: Path, drafter: Path, alternatives: dict[str, tuple[str, Path]], tmp: Path,
                  gamma: int = 3, ready_s: float = 300) -> Iterator[Served]:
    """``specula serve MODEL_DIR --drafter DIR --gamma N --config ports.yaml`` as a subprocess on its own local Ray
    (2 CPUs, a short temp dir, auth off). The config file holds only what the command line cannot say: 127.0.0.1
    and free ports, one torch thread and no CPU reservation per replica, deadlines far above any step on a busy
    machine (a fallback would be the machine, not the drafter), ``drafter.alternatives`` (name -> (kind, dir)):
    more trained drafters next to ``--drafter``'s, chosen per request by the ``drafter`` extension field, and
    model.path (see below). Stopped by SIGTERM (specula serve's clean shutdown), then SIGKILL to its process group
    if it is still there after 90 s."""
    port = free_port()
    drafter_section = {"propose_timeout_s": 120.0, "connect_timeout_s": 60.0,
                       "alternatives": {n: {"kind": k, "options": {"path": str(d)}}
                                        for n, (k, d) in alternatives.items()}}
    raw = make_config(model_dir, drafter=drafter_section, http={"host": "127.0.0.1", "port": port}) \
        .model_dump(mode="json")
    # --drafter replaces the drafter's kind and options and keeps the rest. model.path stays in the file although
    # MODEL_DIR says it too: specula serve validates --config alone before applying the flags (runtime/serve/
    # launch.py serve_cli), so alternatives trained for MODEL_DIR would be checked against the default model
    raw["model"] = {"path": str(model_dir)}
    cfg_file = tmp / "ports.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    log = tmp / "serve.log"
    with ray_env() as ray_tmp, open(log, "wb") as sink:
        env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "specula.cli", "serve", str(model_dir), "--drafter", str(drafter),
               "--gamma", str(gamma), "--config", str(cfg_file), "--num-cpus", "2", "--ray-temp-dir", ray_tmp]
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError(f"specula serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
                return "specula: serving" in log.read_text()

            wait_for("specula serve ready", ready, ready_s, every=1.0)
            yield Served(f"http://127.0.0.1:{port}", log)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``specula serve`` alone (it stops Serve and its Ray, then exits); SIGKILL to the group if not."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def text_law(law, tokenizer):
    """``law`` (distribution_check.Law over token cells [C, k]) as the law of what the OpenAI route answers, its text.

    A cell's text can depend on how the server chunked its tokens (``served_text``: each verify step emits its
    accepted drafts and one more token at once), and byte tokens decode to U+FFFD alike, so cells are merged into
    classes: two cells share a class when some chunking of one gives a text some chunking of the other gives. An
    answer's class is then a function of its cell, and the chi-square on classes is still exact. Returns the
    grouped Law (cells [G, 1]: a class's index) and text -> class."""
    from itertools import product

    from distribution_check import Law

    k = law.cells.shape[1]
    parent = list(range(len(law.cells)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}  # text -> a cell giving it
    for i, cell in enumerate(law.cells.tolist()):
        for cuts in product((False, True), repeat=k - 1):  # every chunking: cut after token j or not
            chunks, cur = [], [cell[0]]
            for j, cut in enumerate(cuts):
                if cut:
                    chunks.append(cur)
                    cur = []
                cur.append(cell[j + 1])
            text = served_text(tokenizer, [*chunks, cur])
            if text in owner:
                parent[root(i)] = root(owner[text])
            else:
                owner[text] = i
    classes = {r: n for n, r in enumerate(sorted({root(i) for i in range(len(law.cells))}))}
    probs = torch.zeros(len(classes), dtype=torch.float64)  # [G]
    for i, p in enumerate(law.probs):
        probs[classes[root(i)]] += p
    index = {text: classes[root(i)] for text, i in owner.items()}
    return Law(torch.arange(len(classes))[:, None], probs, []), index
