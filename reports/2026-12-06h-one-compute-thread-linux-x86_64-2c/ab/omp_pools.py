"""A/B: the embedded target's verify (4 drafts) and decode step, median of 40 each, on 2 torch threads, run
  (a) on the main thread, after loading there;
  (b) on a second thread of the same process, after (a): two OpenMP pools in the process;
  (c) on a second thread of a fresh process whose torch work all ran on that thread: one pool.
Usage: python ab/omp_pools.py          (prints three lines; run on a quiet machine)
"""

import subprocess
import sys
import threading
import time

import torch

from specula.targets.types import Accept, DraftBlock


def bench(tag: str) -> None:
    from specula.runtime.bench.served import _load, world_prompts

    torch.set_num_threads(2)
    target, processor = _load("target")
    p = world_prompts(processor, ["caption"], 1, 0)[0]
    target.prefill([p.encoded.prefill("r")])
    target.commit([Accept("r", (), 5)])
    ver, dec = [], []
    for _ in range(40):
        t0 = time.perf_counter()
        target.verify(DraftBlock(("r",), torch.full((1, 4), 7), None, (4,)))
        ver.append(time.perf_counter() - t0)
        target.commit([Accept("r", (0, 1, 2, 3), 5)])
        t0 = time.perf_counter()
        target.decode_step(["r"])
        dec.append(time.perf_counter() - t0)
        target.commit([Accept("r", (), 5)])
    print(f"{tag}: verify(4) {1e3 * sorted(ver)[20]:.2f} ms, decode {1e3 * sorted(dec)[20]:.2f} ms", flush=True)


def in_thread(tag: str) -> None:
    t = threading.Thread(target=bench, args=(tag,))
    t.start()
    t.join()


if __name__ == "__main__":
    if sys.argv[1:] == ["--only-thread"]:
        in_thread("(c) second thread, the process's only torch thread")
    else:
        bench("(a) main thread")
        in_thread("(b) second thread, main thread used torch first")
        subprocess.run([sys.executable, __file__, "--only-thread"], check=True)
