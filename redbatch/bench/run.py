"""redbatch bench (or scripts/bench): W1, W2 and W3 through redbatch, the naive baseline
and the bare model, measured in one run on this machine, with ratios against the baselines.

Workloads (docs/benchmarks.md): POST {"x": [16 or 64 floats]},
wrk -t1 at 64 connections (throughput, p50/p90/p99) and at 1 connection (latency),
in rounds where redbatch and the naive server take turns (--rounds);
W2 is the torch MLP (64-1024-1024-16, one torch thread), batched at most 32 with a
5 ms window.  Also: the producer path (``bench/producer.py``: no HTTP), mean
batch size and queue wait vs forward time (from the workers' counters), a
concurrency sweep plotted to a PNG, and a JSON file for comparing runs.
W3 (the text classifier ``textcls``, 64 bodies of 8 to 458 tokens) is ``bench/w3.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from redbatch import defaults, protocol
from redbatch.bench import (
    hot,
    priority,
    producer,
    redis_cost,
    replication,
    servers,
    shards,
    w3,
)
from redbatch.bench.mlp import build_mlp
from redbatch.bench.servers import W2_X, Procs, cpu_seconds, wrk

PRODUCER_LABELS = {"predict": f"predict x{producer.PREDICT_TASKS}",
                   "predict_many": f"predict_many {producer.MANY_TASKS}x{producer.MANY_PER_CALL}"}


def worker_sizes(redis_url: str, model: str) -> list[dict[str, int]]:
    """Each live worker's ``auto_sizes``: length bucket -> the pass size it chose."""
    raw = redis.Redis.from_url(redis_url)
    try:
        infos = [json.loads(v) for v in raw.hvals(protocol.worker_info_key(model))]
    finally:
        raw.close()
    return [{str(b): int(n) for b, n in (i.get("auto_sizes") or {}).items()} for i in infos]


def batch_counters(redis_url: str, model: str) -> dict[str, float]:
    raw = redis.Redis.from_url(redis_url)
    totals = {"batches": 0.0, "items": 0.0, "entries": 0.0, "forward_ms": 0.0,
              "forward_cpu_ms": 0.0, "queue_wait_ms": 0.0, "padded": 0.0, "real": 0.0}
    for value in raw.hvals(protocol.worker_info_key(model)):
        info = json.loads(value)
        for key in totals:
            totals[key] += float(info.get(key, 0))
    raw.close()
    return totals


@dataclass(frozen=True)
class Target:
    """One server's side of a workload: where wrk sends it, and whose CPU it uses."""

    name: str
    url: str
    lua: str
    pids: list[int]
    redis_url: str | None = None  # redbatch: the workers' counters live there
    model: str = ""
    # live knobs of ``model`` set before each of this target's runs (an interleaved
    # A/B of one stack: None drops an override), at ``knobs_url``
    knobs: dict[str, Any] | None = None
    knobs_url: str | None = None


def _prepare(target: Target) -> None:
    """Set the target's live knobs before its run (``Target.knobs``)."""
    if target.knobs is not None and target.knobs_url is not None:
        w3.configure(target.knobs_url, target.knobs, target.model)


def interleaved(targets: list[Target], args: argparse.Namespace,
                after_round: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    """Each target at 64 connections (with its servers' CPU per request and, for
    redbatch, the batching counters), then at 1 connection; ``args.rounds`` rounds that
    take the targets in turn, so that a machine that speeds up or slows down during the
    run (a shared VM does) moves every target's figures alike.  ``after_round`` runs
    after each 64-connection round (the servers idle): a measurement to interleave."""
    for target in targets:
        _prepare(target)
        wrk(target.url, target.lua, 64, args.warmup_s)
    before = _counters(targets)
    c64 = _rounds(targets, args, 64, after_round)
    after = _counters(targets)  # the 64-connection rounds only
    cases: dict[str, dict[str, Any]] = {t.name: {"c64": c64[t.name]} for t in targets}
    for name, counters in after.items():
        cases[name]["batching"] = batching(before[name], counters)
    c1 = _rounds(targets, args, 1)
    for t in targets:
        cases[t.name]["c1"] = c1[t.name]
    return cases


def _counters(targets: list[Target]) -> dict[str, dict[str, float]]:
    """The workers' counters for the targets served through Redis (redbatch)."""
    counted = [(t.name, t.redis_url, t.model) for t in targets if t.redis_url]
    if counted:
        time.sleep(1.2)  # the workers' counters ride on their 1 s heartbeat
    return {name: batch_counters(url, model) for name, url, model in counted}


def _rounds(targets: list[Target], args: argparse.Namespace, connections: int,
            after_round: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    runs: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for _ in range(args.rounds):
        for target in targets:
            runs[target.name].append(measured(target, connections, args.duration_s))
        if after_round is not None:
            after_round()
    return {name: merge(results) for name, results in runs.items()}


def measured(target: Target, connections: int, duration_s: float) -> dict[str, Any]:
    """One wrk run, with the CPU its servers used and, for a target served through
    Redis, what Redis spent (``redis_cost``: one INFO before, one after)."""
    _prepare(target)
    cost_before = redis_cost.snapshot(target.redis_url) if target.redis_url else {}
    cpu_before = cpu_seconds(target.pids)
    result = wrk(target.url, target.lua, connections, duration_s)
    result["cpu_s"] = cpu_seconds(target.pids) - cpu_before
    if target.redis_url:
        result.update(redis_cost.spent(cost_before, redis_cost.snapshot(target.redis_url)))
    return result


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one target as one figure: throughput over all of them, each latency
    percentile the median of the rounds', errors summed; each round's req/s kept."""
    requests = sum(r["requests"] for r in runs)
    duration_us = sum(r["duration_us"] for r in runs)
    out: dict[str, Any] = {"requests": requests, "duration_us": duration_us,
                           "rps": requests * 1e6 / max(duration_us, 1),
                           "rps_rounds": [round(r["rps"], 1) for r in runs]}
    for key in runs[0]:
        if key.startswith("lat_"):
            out[key] = statistics.median(r[key] for r in runs)
        elif key.startswith("err") or key == "cpu_s":
            out[key] = sum(r[key] for r in runs)
    out["server_cpu_ms_per_request"] = out.pop("cpu_s") * 1000 / max(requests, 1)
    redis_spent = redis_cost.total(runs)
    if redis_spent:
        out.update(redis_cost.per_request(redis_spent, requests))
    return out


def batching(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in before}
    batches = max(d["batches"], 1.0)
    return {"mean_batch": d["items"] / batches, "fill_ratio": d["items"] / batches / 32,
            "forward_ms_per_batch": d["forward_ms"] / batches,
            "queue_wait_ms_per_entry": d["queue_wait_ms"] / max(d["entries"], 1.0),
            "items_per_entry": d["items"] / max(d["entries"], 1.0),
            # variable lengths: real tokens per second of forward, padded over real
            "real_per_forward_s": d.get("real", 0.0) * 1000 / max(d["forward_ms"], 1e-9),
            "real_per_forward_cpu_s": d.get("real", 0.0) * 1000 / max(d.get("forward_cpu_ms", 0.0),
                                                                      1e-9),
            "pad_ratio": d.get("padded", 0.0) / max(d.get("real", 0.0), 1.0)}


def bare_model(duration_s: float) -> dict[str, float]:
    """Items/s of the W2 model in a loop, with list -> tensor -> list (the bare model)."""
    import torch

    torch.set_num_threads(1)
    model = build_mlp().eval()
    out = {}
    for batch in (32, 1):
        xs = [W2_X] * batch
        done, started = 0, time.perf_counter()
        with torch.inference_mode():
            while time.perf_counter() - started < duration_s:
                model(torch.tensor(xs, dtype=torch.float32)).tolist()
                done += batch
        out[f"batch{batch}_items_per_s"] = done / (time.perf_counter() - started)
    return out


def faster_of(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The bare model, measured before and after the producer path: the faster figure
    of each (the producer path's share is then the lower one), and both runs."""
    return {**{key: max(before[key], after[key]) for key in before}, "runs": [before, after]}


def sweep(urls: dict[str, str], levels: list[int], duration_s: float) -> dict[str, Any]:
    return {name: {str(c): wrk(url, "w2.lua", c, duration_s) for c in levels}
            for name, url in urls.items()}


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in result.items():
        levels = [int(c) for c in runs]
        left.plot(levels, [runs[str(c)]["rps"] for c in levels], marker="o", label=name)
        right.plot(levels, [runs[str(c)]["lat_p99_us"] / 1000 for c in levels], marker="o",
                   label=name)
    for ax, label in ((left, "requests/s"), (right, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent connections (wrk)")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle("W2 (torch MLP) over HTTP, this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def fmt(case: dict[str, Any]) -> str:
    c64, c1 = case["c64"], case["c1"]
    return (f"{c64['rps']:>8.0f} {c64['lat_p50_us'] / 1000:>8.2f} {c64['lat_p99_us'] / 1000:>8.2f}"
            f" {c1['lat_p50_us'] / 1000:>8.2f} {c64['server_cpu_ms_per_request']:>8.3f}"
            f" {redis_cost.shown(c64):>9} {c64['errors'] + c1['errors']:>6}")


def report(res: dict[str, Any]) -> None:
    if "redbatch_w2" in res:
        report_w1_w2(res)
    if "redbatch_w3" in res:
        w3.report(res)


def report_w1_w2(res: dict[str, Any]) -> None:
    print("\nsystem / workload          rps@64   p50@64   p99@64    p50@1  cpu/req redis/req"
          " errors  (ms; redis/req: µs of Redis CPU)")
    for key in ("redbatch_w1", "naive_w1", "ray_w1", "redbatch_w2", "naive_w2", "ray_w2"):
        if key in res:
            print(f"  {key:<24} {fmt(res[key])}")
    for wl in ("w1", "w2"):
        for other in ("naive", "ray"):
            if f"{other}_{wl}" in res:
                print(f"  {wl}: {ratios(res[f'redbatch_{wl}'], res[f'{other}_{wl}'], other)}")
    b = res["redbatch_w2"]["batching"]
    print(f"  w2 batching: mean batch {b['mean_batch']:.1f} (fill {b['fill_ratio']:.0%}), "
          f"forward {b['forward_ms_per_batch']:.2f} ms/batch, queue wait "
          f"{b['queue_wait_ms_per_entry']:.2f} ms per queue entry, "
          f"{b['items_per_entry']:.1f} requests per entry")
    bare = res["bare_model"]["batch32_items_per_s"]
    print(f"  bare model: {bare:.0f} items/s at batch 32, "
          f"{res['bare_model']['batch1_items_per_s']:.0f} at batch 1")
    _report_producer(res, bare)


def _report_producer(res: dict[str, Any], bare: float) -> None:
    """The producer path's items/s (and share of the bare model), and Redis's CPU per
    item, by layout and way in."""
    print("  producer path, no HTTP (items/s, and % of the bare model at batch 32):")
    for layout, figures in res["producer"].items():
        print(f"    {layout:<10}  " + "; ".join(
            f"{PRODUCER_LABELS[way]} {rate:.0f} ({rate / bare:.0%})"
            for way, rate in figures.items()))
    for layout, costs in res.get("producer_redis", {}).items():
        print(f"    {layout:<10}  Redis CPU per item: " + "; ".join(
            f"{PRODUCER_LABELS[way]} {redis_cost.shown(cost, 'item')} µs"
            for way, cost in costs.items()))


def ratios(ours: dict[str, Any], other: dict[str, Any], name: str) -> str:
    return (f"throughput x{ours['c64']['rps'] / other['c64']['rps']:.2f} of {name}; "
            f"p50@1 {(ours['c1']['lat_p50_us'] - other['c1']['lat_p50_us']) / 1000:+.2f} ms; "
            f"p99@64 x{ours['c64']['lat_p99_us'] / other['c64']['lat_p99_us']:.2f}")


def run(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    procs = Procs(logdir)
    try:
        redis_url, ours = servers.start_redbatch(procs, args.gateways)
        res: dict[str, Any] = {"args": vars(args), "started": time.strftime("%FT%TZ")}
        if not args.w3_only:
            run_w1_w2(procs, args, res, redis_url, ours)
        run_w3(procs, args, res, redis_url, ours)
        if args.ray:  # last: Ray's idle daemons would take CPU from the other figures
            run_ray(procs, args, res)
        return res
    finally:
        procs.stop()


def run_w1_w2(procs: Procs, args: argparse.Namespace, res: dict[str, Any], redis_url: str,
              ours: str) -> None:
    """W1 and W2 against the naive server (1 process), the producer path, the bare
    model and the W2 concurrency sweep."""
    naive = servers.start_naive(procs)
    try:
        mine, theirs = procs.pids("redis", "worker", "gateway"), procs.pids("naive")
        for wl, model in (("w1", "echo"), ("w2", "mlp")):
            res.update(interleaved([
                Target(f"redbatch_{wl}", f"{ours}/v1/models/{model}/predict", f"{wl}.lua",
                       mine, redis_url, model),
                Target(f"naive_{wl}", f"{naive}/{wl}", f"{wl}.lua", theirs)], args))
        before = bare_model(min(args.duration_s, 3.0))
        res["producer"], res["producer_redis"] = producer.measure(
            procs, redis_url, args.duration_s * args.rounds)
        res["bare_model"] = faster_of(before, bare_model(min(args.duration_s, 3.0)))
        res["sweep_w2"] = sweep({"redbatch": f"{ours}/v1/models/mlp/predict",
                                 "naive": f"{naive}/w2"}, sweep_levels(args), args.sweep_s)
    finally:
        procs.stop_one("naive")


def sweep_levels(args: argparse.Namespace) -> list[int]:
    return [1, 64] if args.quick else [1, 4, 16, 64, 256]


def run_w3(procs: Procs, args: argparse.Namespace, res: dict[str, Any], redis_url: str,
           ours: str) -> None:
    """W3 against the naive server with 2 processes (the anchors' forward at ``/w3``,
    and the forward that ``textcls`` serves at ``/w3served``), and the bare model's
    sweep, a round of it after each round of the servers at 64 connections."""
    w3.write_bodies(procs.logdir)
    naive = servers.start_naive(procs, "naive2", workers=2)
    extra = [f"worker-w3-{i}" for i in range(1, args.w3_replicas)]  # beside the run's one
    for name in extra:
        servers.start_worker(procs, redis_url, name)
    try:
        producer.wait_live_workers(redis_url, "textcls", args.w3_replicas)
        w3.check_replies([f"{ours}/v1/models/textcls/predict", f"{naive}/w3",
                          f"{naive}/w3served"])
        if args.w3_knob:
            w3.configure(redis_url, dict(args.w3_knob))
        if args.auto_batch:
            w3.learn_sizes(redis_url, f"{ours}/v1/models/textcls/predict")
        knobs_now = w3.configure(redis_url, None)  # redbatch_w3's arm (an A/B's too)
        sweep = w3.BareSweep(0.2 if args.quick else 0.5)
        cases = interleaved(w3_targets(procs, args, redis_url, ours, naive, extra, knobs_now),
                            args, sweep.round)
        cases["redbatch_w3"]["auto_sizes"] = worker_sizes(redis_url, "textcls")
        cases["redbatch_w3"]["pad_to_longest"] = knobs_now["pad_to_longest"]
    finally:
        for name in ("naive2", *extra):
            procs.stop_one(name)
    res.update({name: w3.tokens(case) for name, case in cases.items()})
    if args.w3_ab:
        res["w3_ab"] = list(args.w3_ab)
    res["bare_w3"] = sweep.result()  # (its rounds taken between the 64-connection rounds)


def w3_targets(procs: Procs, args: argparse.Namespace, redis_url: str, ours: str, naive: str,
               extra: list[str], knobs_now: dict[str, Any]) -> list[Target]:
    """W3's targets; with ``--w3-ab KNOB=JSON``, ``redbatch_w3_ab`` too: the same stack
    with that knob set before each of its runs, and set back to its value before the
    rounds (``knobs_now``: the model's own, or ``--w3-knob``'s) before each of
    ``redbatch_w3``'s (an interleaved A/B of one knob)."""
    url, pids = f"{ours}/v1/models/textcls/predict", procs.pids("redis", "worker", *extra,
                                                               "gateway")
    targets = [Target("redbatch_w3", url, "w3.lua", pids, redis_url, "textcls")]
    if args.w3_ab:
        name, value = args.w3_ab
        targets = [dataclasses.replace(targets[0], knobs={name: knobs_now.get(name)},
                                       knobs_url=redis_url),
                   Target("redbatch_w3_ab", url, "w3.lua", pids, None, "textcls",
                          {name: value}, redis_url)]
    return [*targets, Target("naive2_w3", f"{naive}/w3", "w3.lua", procs.pids("naive2")),
            Target("naive2_w3_served", f"{naive}/w3served", "w3.lua", procs.pids("naive2"))]


def run_ray(procs: Procs, args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Ray Serve's workloads in this run (its whole process tree counts as its CPU)."""
    base = servers.start_ray(procs, args.ray)
    w3.check_replies([f"{base}/w3"])
    pids = procs.pids("ray")
    for wl in ("w3",) if args.w3_only else ("w1", "w2", "w3"):
        case = interleaved([Target(f"ray_{wl}", f"{base}/{wl}", f"{wl}.lua", pids)], args)
        res.update({name: w3.tokens(c) if wl == "w3" else c for name, c in case.items()})
    if "sweep_w2" in res:
        res["sweep_w2"].update(sweep({"ray": f"{base}/w2"}, sweep_levels(args), args.sweep_s))


BENCH_HELP = """W1 (a no-op model), W2 (a torch MLP, batched at most 32 with a 5 ms window) and
W3 (a transformer text classifier over 8 to 458 tokens, in tokens/s) through redbatch,
a naive FastAPI server and the bare model, measured in one run on this machine, with
ratios against the baselines (method: docs/benchmarks.md).

HTTP load comes from wrk -t1 at 64 connections (throughput, p50/p90/p99) and at one
connection (latency), in rounds where redbatch and the naive server take turns
(--rounds). Also: the Python client's path without HTTP, mean batch size and queue
wait against forward time, a concurrency sweep plotted to a PNG, and a JSON file for
comparing runs (in --out)."""


def _knob_arg(text: str) -> tuple[str, Any]:
    """``KNOB=JSON`` (``--w3-knob``) as a knob name and its value."""
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: give KNOB=JSON, e.g. pad_to_longest=false")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not JSON ({exc})") from exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--stream" in argv:  # the streaming benchmark, with flags of its own
        from redbatch.bench import stream

        return stream.main([a for a in argv if a != "--stream"])
    return _bench(argv)


def main_parser() -> argparse.ArgumentParser:
    """``redbatch bench``'s flags (``--stream`` has flags of its own)."""
    parser = argparse.ArgumentParser(prog="redbatch bench", description=BENCH_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs (about 2 minutes)")
    parser.add_argument("--duration-s", type=float, help="each wrk run (default 4; quick 3)")
    parser.add_argument("--rounds", type=int, help="rounds of wrk runs per figure, the "
                        "servers of a workload taking turns (default 3; quick 1)")
    parser.add_argument("--gateways", type=int, default=defaults.GATEWAY_PROCESSES,
                        help=f"gateway processes ({defaults.GATEWAY_PROCESSES}, as "
                        "`redbatch gateway`)")
    parser.add_argument("--w3-only", action="store_true",
                        help="only W3 (the text classifier; with Ray Serve under --ray)")
    parser.add_argument("--w3-replicas", type=int, default=2,
                        help="worker replicas for W3 (2, as the naive server's 2 processes)")
    parser.add_argument("--auto-batch", action="store_true",
                        help="W3 with the live knob auto_batch on (pass sizes per length "
                             "bucket by measurement), after a warm-up that lets it learn")
    parser.add_argument("--w3-knob", type=_knob_arg, action="append", default=[],
                        metavar="KNOB=JSON", help="W3 with this live knob of textcls set "
                        "first (repeatable), e.g. --w3-knob pad_to_longest=false")
    parser.add_argument("--w3-ab", type=_knob_arg, metavar="KNOB=JSON",
                        help="W3 also as redbatch_w3_ab: the same stack with this live "
                        "knob set, taking turns with redbatch_w3 (its value before the "
                        "rounds) in every round")
    parser.add_argument("--priority", action="store_true",
                        help="only the priority overload scenario (about a minute: "
                             "bench/priority.py)")
    parser.add_argument("--pipeline", action="store_true",
                        help="only the pipeline overhead (about a minute: bench/pipeline.py)")
    parser.add_argument("--replica-wait", action="store_true",
                        help="only the cost of REDBATCH_WAIT_REPLICAS: W2's producer path "
                             "against a primary and a replica, WAIT off and on "
                             "(bench/replication.py)")
    parser.add_argument("--shards", action="store_true",
                        help="only the shard curve: items/s and Redis CPU per item on "
                             "Redis Clusters of 1, 2 and 3 primaries (bench/shards.py)")
    parser.add_argument("--hot", action="store_true",
                        help="only one hot model on a 3-primary Redis Cluster with "
                             "sub_queues 1 and 3 (bench/hot.py)")
    parser.add_argument("--stream", action="store_true",
                        help="only the streaming benchmark, with flags of its own "
                             "(redbatch bench --stream --help; bench/stream.py)")
    parser.add_argument("--out", default="bench-results", help="folder for JSON and PNG")
    parser.add_argument("--ray", metavar="PYTHON",
                        help="also run Ray Serve, with this Python (it needs ray[serve] and "
                             "torch==2.13.0: see docs/benchmarks.md)")
    return parser


def _bench(argv: list[str]) -> int:
    parser = main_parser()
    args = parser.parse_args(argv)
    args.duration_s = args.duration_s or (3.0 if args.quick else 4.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if min(args.rounds, args.gateways, args.w3_replicas) < 1 or args.duration_s <= 0:
        parser.error("--rounds, --gateways and --w3-replicas must be at least 1, "
                     "--duration-s positive")
    args.warmup_s = 1.0 if args.quick else 3.0
    args.sweep_s = 2.0 if args.quick else 5.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="redbatch-bench-"))
    if args.priority:
        return run_priority(out, logdir)
    if args.pipeline:
        return run_pipeline(out, logdir)
    if args.replica_wait:
        return run_replica_wait(out, logdir, args)
    if args.shards:
        return run_shards(out, logdir, args)
    if args.hot:
        res = hot.run(logdir, args.duration_s, args.rounds)
        hot.report(res)
        return _saved(out, "hot", res, logdir)
    res = run(args, logdir)
    report(res)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"bench-{stamp}.json").write_text(json.dumps(res, indent=2))
    png = out / f"sweep-{stamp}.png"
    plotted = "sweep_w2" in res and plot(res["sweep_w2"], png)
    print(f"\nresults: {out / f'bench-{stamp}.json'}"
          f"{'; plot: ' + str(png) if plotted else ''}; logs: {logdir}")
    return 0


def run_replica_wait(out: Path, logdir: Path, args: argparse.Namespace) -> int:
    res = replication.run(logdir, args.duration_s, args.rounds)
    replication.report(res)
    return _saved(out, "replica-wait", res, logdir)


def run_shards(out: Path, logdir: Path, args: argparse.Namespace) -> int:
    res = shards.run(logdir, args.duration_s, args.rounds)
    shards.report(res)
    png = out / f"shards-{time.strftime('%Y%m%d-%H%M%S')}.png"
    if shards.plot(res, png):
        print(f"plot: {png}")
    return _saved(out, "shards", res, logdir)


def run_pipeline(out: Path, logdir: Path) -> int:
    from redbatch.bench import pipeline

    res = pipeline.run(logdir)
    pipeline.report(res)
    return _saved(out, "pipeline", res, logdir)


def run_priority(out: Path, logdir: Path) -> int:
    res = priority.run(logdir)
    priority.report(res)
    return _saved(out, "priority", res, logdir)


def _saved(out: Path, name: str, res: dict[str, Any], logdir: Path) -> int:
    """Write a single scenario's results as JSON in ``out``; say where they are."""
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=2))
    print(f"\nresults: {path}; logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
