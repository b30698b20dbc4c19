"""W3 in a bench run: the text classifier (``textcls``) over the 64 bodies of 8 to 458
tokens, through redbatch and the naive server with 2 processes (and Ray Serve under
``--ray``), in tokens/s = req/s x mean length; and the bare model's best strategy,
measured in-process in the same run: for each length bucket, the batch size (1 to 32)
whose passes, padded to the bucket, give the most real tokens per CPU-second (three
rounds, one after each round of the servers at 64 connections, so that the sweep and
the workers' passes see the same drift of the machine; the median of each size's);
and the same with each pass padded to its longest body (as ``textcls`` pads with
``pad_to_longest``; the sweep's passes take the bucket's bodies in their order, where
a worker sorts a claim's by length)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

from redbatch.bench import redis_cost, textcls
from redbatch.spec import power_buckets
from redbatch.worker.ragged import pad_batch

BODIES_ENV = "REDBATCH_W3_BODIES"  # wrk/w3.lua reads the bodies from this file
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SWEEP_ROUNDS = 3  # interleaved rounds per bucket of the bare sweep


def write_bodies(logdir: Path) -> None:
    """The bodies file ``wrk/w3.lua`` sends (its path in the environment wrk inherits)."""
    path = logdir / "w3_bodies.json"
    path.write_text(textcls.bodies_text())
    os.environ[BODIES_ENV] = str(path)


CHECKED = (0, 20, 21, 33)  # bodies of 11, 8, 458 and 385 tokens
TOLERANCE = 1e-4


def check_replies(urls: list[str]) -> None:
    """Each server's logits for a few bodies against the model's own at batch 1, sent
    together so that a batching server pads them (and waits for it to load)."""
    import numpy as np
    import torch

    from redbatch.bench.servers import wait_ok

    model, sent = textcls.build_textcls(), [textcls.bodies()[i] for i in CHECKED]
    with torch.inference_mode():
        want = [model(torch.tensor([b["input_ids"]]), torch.tensor([len(b["input_ids"])]))
                .numpy()[0] for b in sent]
    for url in urls:
        wait_ok(url, sent[0])
        got = _post_all(url, sent)
        worst = max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want, strict=True))
        if worst > TOLERANCE:
            raise SystemExit(f"bench: {url} answers W3 logits {worst:.1e} off the model's")


def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[list[float]]:
    import httpx

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: httpx.post(url, json=b, timeout=30), bodies))
    return [r.raise_for_status().json()["logits"] for r in replies]


WARMUP_S = 6.0  # W3 load before the rounds, with auto_batch on: the sizes are learned


def configure(redis_url: str, values: dict[str, Any] | None, model: str = "textcls"
              ) -> dict[str, Any]:
    """Set live knobs of ``model`` (``redbatch config``; None drops an override) and
    wait until the workers have read them with their heartbeat (1 s); the knobs in
    effect (``values`` None: only read them, no wait)."""
    import asyncio

    import redis.asyncio as aioredis

    from redbatch import knobs

    async def store() -> dict[str, Any]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            if values is None:
                shown = await knobs.show(client, model)
            else:
                shown = await knobs.configure(client, model, values)
        finally:
            await client.aclose()
        return dict(shown["effective"])

    effective = asyncio.run(store())
    if values is not None:
        time.sleep(2.5)
    return effective


def learn_sizes(redis_url: str, url: str) -> None:
    """Turn the live knob ``auto_batch`` on for ``textcls`` and send W3 at 64
    connections for ``WARMUP_S``, so that the workers have chosen their pass sizes
    before the measured rounds (they keep learning during them)."""
    from redbatch.bench.servers import wrk

    configure(redis_url, {"auto_batch": True})
    wrk(url, "w3.lua", 64, WARMUP_S)


def mean_len() -> float:
    lengths = textcls.lengths()
    return sum(lengths) / len(lengths)


def buckets() -> dict[int, list[list[int]]]:
    """Bucket length (powers of two up to 512, as the worker's) -> its bodies' ids."""
    bounds = power_buckets(textcls.MAX_LEN)
    out: dict[int, list[list[int]]] = {}
    for body in textcls.bodies():
        ids = body["input_ids"]
        out.setdefault(next(b for b in bounds if b >= len(ids)), []).append(ids)
    return dict(sorted(out.items()))


def _rate(model: Any, rows: list[list[int]], length: int | None, batch: int,
          duration_s: float) -> float:
    """Real tokens per CPU-second of this thread (torch runs on it: one intra-op
    thread, as the worker times its passes) of passes of ``batch`` rows (cycling
    through ``rows``, in the bodies' order), padded to ``length`` as the worker pads
    them (None: to each pass's longest row), forward and back to numpy included; for
    ``duration_s`` of wall time, after one untimed pass."""
    import numpy as np
    import torch

    passes = [[np.asarray(rows[(start + k) % len(rows)], dtype=np.int64) for k in range(batch)]
              for start in range(len(rows))]

    def one(i: int) -> int:
        rows_i = passes[i % len(passes)]
        padded, lens = pad_batch(rows_i, length or max(map(len, rows_i)), 0)
        model(torch.from_numpy(padded), torch.from_numpy(lens)).numpy()
        return int(lens.sum())

    with torch.inference_mode():
        one(0)  # (a shape's first pass allocates)
        done, i, started, cpu = 0, 0, time.perf_counter(), time.thread_time()
        while time.perf_counter() - started < duration_s:
            done, i = done + one(i), i + 1
    return done / max(time.thread_time() - cpu, 1e-9)


def _round_rates(model: Any, rows: list[list[int]], length: int | None, duration_s: float,
                 r: int) -> dict[int, float]:
    """Round ``r`` of a sweep: each batch size's rate (``_rate``) for ``duration_s``,
    the sizes in an order rotated by ``r``."""
    order = BATCH_SIZES[r % len(BATCH_SIZES):] + BATCH_SIZES[:r % len(BATCH_SIZES)]
    return {b: _rate(model, rows, length, b, duration_s) for b in order}


STRATEGIES = (("plain", False), ("served", False), ("served_longest", True))


class BareSweep:
    """The bare model's sweep (``bare_sweep``) in ``SWEEP_ROUNDS`` rounds that a bench
    run interleaves with its serving rounds (``round`` after each), so that the
    workers' passes and the best strategy they are held to are measured over the same
    stretch of a machine that drifts; ``result`` runs the rounds still due."""

    def __init__(self, duration_s: float) -> None:
        import torch

        torch.set_num_threads(1)
        self.duration_s = duration_s
        self.models = {"plain": textcls.build_textcls(), "served": textcls.build_served()}
        self.seen: dict[tuple[str, int], dict[int, list[float]]] = {}
        self.rounds = 0

    def round(self) -> None:
        """One round of every strategy and bucket (skipped once all are done)."""
        if self.rounds >= SWEEP_ROUNDS:
            return
        for name, longest in STRATEGIES:
            model = self.models["plain" if name == "plain" else "served"]
            for length, rows in buckets().items():
                rates = _round_rates(model, rows, None if longest else length,
                                     self.duration_s / SWEEP_ROUNDS, self.rounds)
                for b, rate in rates.items():
                    self.seen.setdefault((name, length), {}).setdefault(b, []).append(rate)
        self.rounds += 1

    def result(self) -> dict[str, Any]:
        while self.rounds < SWEEP_ROUNDS:
            self.round()
        out: dict[str, Any] = {name: self._best(name) for name, _ in STRATEGIES}
        out["batch1_exact_tokens_per_s"] = _exact(self.models["plain"], self.duration_s * 3)
        return out

    def _best(self, name: str) -> dict[str, Any]:
        """Per bucket: tokens/s at each batch size (its rounds' median) and the best;
        overall, the tokens/s over the 64 bodies with each bucket at its best size."""
        out: dict[str, Any] = {"buckets": {}}
        seconds = 0.0
        for length, rows in buckets().items():
            rates = {b: median(v) for b, v in self.seen[(name, length)].items()}
            best = max(rates, key=lambda b: rates[b])
            out["buckets"][str(length)] = {"bodies": len(rows), "tokens_per_s": rates,
                                           "best_batch": best}
            seconds += sum(map(len, rows)) / rates[best]
        out["best_tokens_per_s"] = sum(textcls.lengths()) / seconds
        return out


def bare_sweep(duration_s: float) -> dict[str, Any]:
    """The best strategy of the anchors' forward (``plain``) and of the forward that
    ``textcls`` serves (``served``: long passes row by row), both padded to the
    buckets; the served forward's with each pass padded to its longest body
    (``served_longest``); and batch 1 at each body's own length (no padding): every
    round at once (``BareSweep`` takes them between serving rounds)."""
    return BareSweep(duration_s).result()


def _exact(model: Any, duration_s: float) -> float:
    """Real tokens/s of batch 1 at each body's own length (no padding at all)."""
    import torch

    rows = [torch.tensor([b["input_ids"]]) for b in textcls.bodies()]
    lens = [torch.tensor([r.shape[1]]) for r in rows]
    done, started, i = 0, time.perf_counter(), 0
    with torch.inference_mode():
        while time.perf_counter() - started < duration_s:
            model(rows[i % len(rows)], lens[i % len(rows)]).numpy()
            done, i = done + rows[i % len(rows)].shape[1], i + 1
    return done / (time.perf_counter() - started)


def tokens(case: dict[str, Any]) -> dict[str, Any]:
    """A W3 case with its tokens/s (req/s x mean length) at 64 and 1 connection."""
    mean = mean_len()
    for key in ("c64", "c1"):
        case[key]["tokens_per_s"] = case[key]["rps"] * mean
    return case


def report(res: dict[str, Any]) -> None:
    print(f"\nW3 (text, 64 bodies of 8-458 tokens, mean {mean_len():.2f})"
          "   tokens/s@64  p50@64  p99@64  p50@1  p99@1 redis/req errors  (ms; redis/req:"
          " µs of Redis CPU)")
    for key in ("redbatch_w3", "redbatch_w3_ab", "naive2_w3", "naive2_w3_served", "ray_w3"):
        if key in res:
            c64, c1 = res[key]["c64"], res[key]["c1"]
            print(f"  {key:<52} {c64['tokens_per_s']:>9.0f} {c64['lat_p50_us'] / 1000:>7.2f}"
                  f" {c64['lat_p99_us'] / 1000:>7.2f} {c1['lat_p50_us'] / 1000:>6.2f}"
                  f" {c1['lat_p99_us'] / 1000:>6.2f} {redis_cost.shown(c64):>9}"
                  f" {c64['errors'] + c1['errors']:>6}")
    ours = res["redbatch_w3"]["c64"]["tokens_per_s"]
    for other, target in (("naive2_w3", 1.1), ("ray_w3", 10.0)):
        if other in res:
            ratio = ours / res[other]["c64"]["tokens_per_s"]
            print(f"  w3: x{ratio:.2f} the tokens/s of {other} (target x{target}: "
                  f"{'met' if ratio >= target else 'NOT met'})")
    if "naive2_w3_served" in res:
        same = ours / res["naive2_w3_served"]["c64"]["tokens_per_s"]
        print(f"  w3: x{same:.2f} the naive server running the forward textcls serves "
              "(batching alone; no target)")
    _report_ab(res)
    _report_bare(res["bare_w3"], res["redbatch_w3"]["batching"])
    padded = "served_longest" if res["redbatch_w3"].get("pad_to_longest") else "served"
    _report_sizes(res["bare_w3"].get(padded, res["bare_w3"]["served"]),
                  res["redbatch_w3"].get("auto_sizes", []))


def _report_ab(res: dict[str, Any]) -> None:
    """``--w3-ab``: the knob's arm against the model's own, round by round."""
    if "redbatch_w3_ab" not in res:
        return
    knob, value = res["w3_ab"]
    a, b = res["redbatch_w3"]["c64"], res["redbatch_w3_ab"]["c64"]
    higher = sum(y > x for x, y in zip(a["rps_rounds"], b["rps_rounds"], strict=True))
    print(f"  w3 A/B: {knob}={value} x{b['tokens_per_s'] / a['tokens_per_s']:.3f} the "
          f"tokens/s of redbatch_w3 (higher in {higher} of {len(a['rps_rounds'])} rounds); "
          "the batching figures below cover both arms' passes")


def _report_bare(bare: dict[str, Any], batching: dict[str, float]) -> None:
    for name, label in (("plain", "the anchors' forward"), ("served", "as served"),
                        ("served_longest", "as served, each pass padded to its longest")):
        if name not in bare:
            continue
        best = bare[name]
        print(f"  bare model ({label}): best strategy {best['best_tokens_per_s']:.0f} tokens/s;"
              " best batch per bucket " + ", ".join(
                  f"{b}:{v['best_batch']} ({v['tokens_per_s'][v['best_batch']]:.0f})"
                  for b, v in best["buckets"].items()))
    print(f"  bare model: batch 1 at each body's own length "
          f"{bare['batch1_exact_tokens_per_s']:.0f} tokens/s")
    best = bare["served"]["best_tokens_per_s"]
    wall, cpu = batching.get("real_per_forward_s", 0.0), batching.get("real_per_forward_cpu_s",
                                                                      0.0)
    print(f"  redbatch's passes: {cpu:.0f} real tokens per forward CPU-second, "
          f"{cpu / best:.0%} of the served forward's best strategy (target 90%: "
          f"{'met' if cpu >= 0.9 * best else 'NOT met'}); {wall:.0f} per forward "
          f"wall-second ({wall / best:.0%}: passes share the cores with the gateway, Redis "
          f"and wrk); mean batch {batching['mean_batch']:.1f}, padding "
          f"{batching.get('pad_ratio', 0.0):.2f}x")
    if "served_longest" in bare:
        same = bare["served_longest"]["best_tokens_per_s"]
        print(f"  redbatch's passes against the best strategy with each pass padded to its "
              f"longest body: {cpu / same:.0%} (like for like with pad_to_longest on; no "
              "target)")


BUCKET_FLOOR = 0.95  # target: each bucket's chosen size within this of max(batch 1, 32)


def size_check(served: dict[str, Any], sizes: list[dict[str, int]]) -> dict[str, float]:
    """Per bucket and worker (``"<bucket>/w<i>"``): the bare served forward's tokens/s at
    the pass size that worker chose for the bucket, over the better of batch 1 and
    batch 32 in the same sweep (a size between sweep points takes the next one below)."""
    out: dict[str, float] = {}
    for i, chosen in enumerate(sizes):
        for bucket, size in chosen.items():
            rates = served["buckets"].get(bucket, {}).get("tokens_per_s")
            if rates:
                at = rates[max(b for b in BATCH_SIZES if b <= max(size, 1))]
                out[f"{bucket}/w{i}"] = at / max(rates[1], rates[BATCH_SIZES[-1]])
    return out


def _report_sizes(served: dict[str, Any], sizes: list[dict[str, int]]) -> None:
    ratios = size_check(served, sizes)
    if not ratios:
        print("  worker's pass sizes: none chosen (auto_batch off, or too few passes)")
        return
    worst = min(ratios.values())
    print("  worker's pass size per bucket (against the sweep padded as the passes are): "
          + ", ".join(
        f"{b}:{n}" for i, chosen in enumerate(sizes) for b, n in chosen.items()
        if i == 0) + f"; worst bucket {worst:.0%} of the better of batch 1 and 32 in the "
        f"bare sweep (target {BUCKET_FLOOR:.0%}: {'met' if worst >= BUCKET_FLOOR else 'NOT met'})")
