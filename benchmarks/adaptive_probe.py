"""The adaptive backend's host pieces in warm loops, next to pkv-workqueue's (B=1 x 8200, H200 host).

    python benchmarks/adaptive_probe.py

Each line: the best (and median) of five loops of 2000-4000 calls, us per call, the GPU drained
every 50 plans or 32 runs. Where benchmarks/adaptive_overhead.py times whole steps interleaved
(cold), this times each piece warm: the difference between the two is what a cold step pays for
the extra code it runs (benchmarks/NOTES.md, "Host")."""
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from graph_timing import rotated_copies  # noqa: E402
from persistentkv.backends import registry  # noqa: E402
from persistentkv.backends.adaptive import AdaptivePlan  # noqa: E402
from persistentkv.cache import make_batch  # noqa: E402
from persistentkv.spec import AttentionSpec  # noqa: E402


def t(name, f, n=2000, sync_every=50):
    """Print the best and median of five loops of ``n`` calls of ``f`` (us per call)."""
    best = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            f()
            if i % sync_every == sync_every - 1:
                torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / n * 1e6)
    print(f"{name:34s} {min(best):8.2f} us  (median {statistics.median(best):.2f})", flush=True)


def main() -> int:
    spec = AttentionSpec(32, 8, 128, 16, "float16")
    batch = make_batch(spec, [8200], seed=1)
    copies, q = rotated_copies(spec, batch, torch.cuda.get_device_properties(0).L2_cache_size)
    out = torch.empty_like(q)
    ad = registry.create("adaptive", policy_path=str(ROOT / "results" / "nvidia-h200" / "policy.json"))
    pk = registry.create("pkv-workqueue")
    for _ in range(5):
        for b in (ad, pk):
            p = b.plan(batch)
            for c in copies[:4]:
                b.run(q, c, p, out)
    torch.cuda.synchronize()
    dele = ad._chosen[2]
    memo = ad._last_entry[1]
    ap = ad.plan(batch)  # the deferred path (the warm-up set its choice): settle it by hand
    ad._settle()
    ip = ap.inner

    t("memo.decide", lambda: memo.decide(batch), sync_every=10**9)
    t("AdaptivePlan()", lambda: AdaptivePlan("pkv-workqueue", ap.decision, dele, ip, ip.engine.run), sync_every=10**9)
    t("ad._settle (via flag)", lambda: (setattr(ad, "_undecided", batch), ad._settle()), sync_every=10**9)
    t("pk.plan", lambda: pk.plan(batch))
    t("dele.plan", lambda: dele.plan(batch))
    t("ad.plan + settle", lambda: (ad.plan(batch), ad._settle()))
    k0 = copies[0]
    t("pk.run (same plan)", lambda: pk.run(q, k0, ip, out), n=4000, sync_every=32)
    t("ad.run (same plan)", lambda: ad.run(q, k0, ap, out), n=4000, sync_every=32)
    t("engine.run direct", lambda: ip.engine.run(q, k0, ip, out), n=4000, sync_every=32)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
