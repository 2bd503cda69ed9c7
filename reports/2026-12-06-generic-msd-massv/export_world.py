"""Issue 63 D6 (msd, massv): the embedded world's prompts of each recipe as a conversation file, PNG images beside it.

    python export_world.py msd     # runs/d6/msd.jsonl: 3,000 vision + 1,500 text prompts (msd's recipe, from
                                   # index 2,000,000 as MsdTrainConfig.data_start) + 32 held-out evaluation records
    python export_world.py massv   # runs/d6/massv.jsonl: 4,000 vision + 800 text prompts (massv's recipe: text_every
                                   # 5, from 3,000,000 as MassvTrainConfig.data_start) + 32 held-out records

The vision prompts are ``world_sample("vision", start + i)`` (the training mix without its text entry), the text
prompts ``world_sample("text", start + i)``, the held-out ones the evaluation suites round robin
(``world_sample("eval", i)``), last in the file, which is where a conversation file's held-out records are.
"""
import itertools
import sys

from specula.training.data.world_export import write_world_conversations
from specula.training.data.world_prompts import world_sample
from specula.world.suites import generate, train_stream

RECIPES = {"msd": (2_000_000, 3000, 1500), "massv": (3_000_000, 4000, 800)}
kind = sys.argv[1]
start, n_vision, n_text = RECIPES[kind]
N_EVAL = 32


def samples():
    vision = itertools.islice(train_stream(seed=0, start=start, weights={"text": 0.0}), n_vision)
    for i, s in enumerate(vision):
        yield f"vision-{start + i}", s
    for i in range(n_text):
        yield f"text-{start + i}", generate("text", "train", start + i, 0)
    for i in range(N_EVAL):
        yield f"eval-{i}", world_sample("eval", i, 0)


print(write_world_conversations(f"runs/d6/{kind}.jsonl", f"runs/d6/images-{kind}", samples(),
                                total=n_vision + n_text + N_EVAL))
