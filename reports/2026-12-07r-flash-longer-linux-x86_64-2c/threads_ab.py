# T_decode, T_verify(gamma) and the prefill at 1 vs 2 torch threads, alternating rounds in one process.
import sys, time, uuid, statistics as stt, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.targets.types import DraftBlock, Accept
target, proc = _load("target")
p = world_prompts(proc, ["caption"], 1)[0]
def round_(threads, reps=30):
    torch.set_num_threads(threads)
    rid = uuid.uuid4().hex
    t0 = time.perf_counter(); target.prefill([p.encoded.prefill(rid)]); tp = time.perf_counter() - t0
    target.commit([Accept(rid, (), 5)])
    dec = []
    for _ in range(reps):
        t0 = time.perf_counter(); out = target.decode_step([rid]); dec.append(time.perf_counter() - t0)
        target.commit([Accept(rid, (), int(out.logits[0, 0].argmax()))])
    ver = {}
    for g in (5, 8):
        ts = []
        for _ in range(reps // 2):
            drafts = torch.randint(10, 900, (1, g))
            t0 = time.perf_counter(); out = target.verify(DraftBlock.chain([rid], drafts)); ts.append(time.perf_counter() - t0)
            target.commit([Accept.chain(rid, 0, int(out.logits[0, 0].argmax()))])
        ver[g] = stt.median(ts) * 1e3
    target.release([rid])
    return tp * 1e3, stt.median(dec) * 1e3, ver[5], ver[8]
res = {1: [], 2: []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for t in ((1, 2) if r % 2 == 0 else (2, 1)):
        res[t].append(round_(t))
for t, rows in res.items():
    cols = list(zip(*rows))
    print(f"threads {t}: prefill {stt.median(cols[0]):.2f} ms, T_decode {stt.median(cols[1]):.3f}, "
          f"T_verify(5) {stt.median(cols[2]):.3f}, T_verify(8) {stt.median(cols[3]):.3f}")
