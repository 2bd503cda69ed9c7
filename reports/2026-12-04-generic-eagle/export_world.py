"""Issue 63 D6: the embedded world's training prompts as a conversation file (the eagle recipe's prompts:
train_stream(seed 0) from 2,000,000), PNG images beside it."""
import itertools, sys
from specula.training.data.world_export import write_world_conversations
from specula.world.suites import train_stream

n = int(sys.argv[1]) if len(sys.argv) > 1 else 3200
samples = ((f"train-{2_000_000 + i}", s) for i, s in enumerate(itertools.islice(train_stream(seed=0, start=2_000_000), n)))
print(write_world_conversations("runs/d6/world.jsonl", "runs/d6/images", samples, total=n))
