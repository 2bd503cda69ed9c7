"""``specula zoo promote``: the candidate zoo (a retrained target and the drafters retrained for it) becomes the
shipped one, all at once.

A new target ships only with every drafter of the recipe retrained on it (a drafter distilled from another target
describes another model; tests/training/test_shipped_drafters.py checks each one's target fingerprint). Retraining the
drafters takes longer than a session, so they are exported one by one into ``zoo/candidates`` beside the
candidate target (``specula zoo build --drafters-only --zoo-dir zoo/candidates``) and committed there as they
finish; this step checks that the set is complete and consistent, then moves it into ``zoo/weights``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specula.zoo import store as manifest
from specula.zoo.store import CANDIDATES_DIR, ZOO_DIR


def recipe_samples(step) -> int:
    """The training samples a recipe drafter step asks for (its ``--samples``, at full scale)."""
    return int(step.argv[step.argv.index("--samples") + 1])


# A warm-started drafter (training/drafters/warm_start.py) counts the samples of the heads it started from, but must have
# trained at least this share of the recipe's samples against the new target itself.
MIN_WARM_SHARE = 0.25


def drafter_problem(entry: Path, fingerprint: str, samples: int) -> str | None:
    """Why ``entry`` does not hold a drafter exported for the target with this fingerprint after at least ``samples``
    training samples (None: it does; a warm-started one counts the samples behind the head it started from, but must
    have trained ``MIN_WARM_SHARE`` of them against this target itself). ``specula zoo build`` skips a drafter without a problem even when its run
    directory is gone (runs/ does not outlive a session here); ``promote`` refuses while any has one."""
    meta = Path(entry) / "specula.json"
    if not meta.exists():
        return "not retrained yet"
    info = json.loads(meta.read_text())
    if info.get("target_sha256") != fingerprint:
        return "trained on another target"
    own, warm = int(info.get("trained_samples") or 0), int(info.get("init_samples") or 0)
    if own + warm < samples:
        return f"trained on {own + warm} samples, the recipe's are {samples}"
    if warm and own < MIN_WARM_SHARE * samples:
        return (f"warm-started, then trained on {own} samples for this target, under {MIN_WARM_SHARE:.0%} of the "
                f"recipe's {samples}")
    return None


def missing(candidates: Path = CANDIDATES_DIR) -> list[str]:
    """What keeps ``candidates`` from being promoted: no target, or recipe drafters absent, trained on another target
    or on fewer samples than the recipe's (empty = ready)."""
    from specula.training.drafters.distill_data import target_fingerprint
    from specula.training.recipe import DRAFTERS

    target = Path(candidates) / "target"
    if not (target / "config.json").exists():
        return [f"{target}: no target"]
    fingerprint = target_fingerprint(target)
    problems = [(d.name, drafter_problem(Path(candidates) / d.name, fingerprint, recipe_samples(d))) for d in DRAFTERS]
    return [f"{name}: {why}" for name, why in problems if why]


def promote(candidates: Path = CANDIDATES_DIR, zoo: Path = ZOO_DIR) -> list[str]:
    """Move every entry of ``candidates`` into ``zoo`` (replacing the shipped entry of that name; the tokenizer and
    any entry the candidates lack stay), rewrite ``zoo``'s manifest, and remove ``candidates``. Returns the names
    moved; raises ValueError (nothing moved) when ``missing`` finds a problem."""
    candidates, zoo = Path(candidates), Path(zoo)
    problems = missing(candidates)
    if problems:
        raise ValueError("the candidate zoo is not complete:\n  " + "\n  ".join(problems))
    names = sorted(d.name for d in candidates.iterdir() if d.is_dir())
    for name in names:
        if (zoo / name).exists():
            shutil.rmtree(zoo / name)
        shutil.move(str(candidates / name), str(zoo / name))
    manifest.write(zoo)
    shutil.rmtree(candidates)
    return names


def promote_cli(args) -> int:
    candidates = Path(args.candidates) if args.candidates else CANDIDATES_DIR
    if args.check:
        problems = missing(candidates)
        print("ready to promote" if not problems else "not ready:\n  " + "\n  ".join(problems))
        return 0 if not problems else 1
    try:
        names = promote(candidates, Path(args.zoo_dir) if args.zoo_dir else ZOO_DIR)
    except ValueError as e:
        print(str(e))
        return 1
    print(f"promoted {', '.join(names)}; now set SHIPPED_UNTIL in training/recipe.py to the candidate's stage")
    return 0
