"""``redbatch versions MODEL [VERSION=WEIGHT ...] [--latest V] [--drain V]
[--undrain V]``: show or change a model's versions and traffic split
(``redbatch.versions``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import orjson

from redbatch import versions
from redbatch.config import RedisSettings
from redbatch.errors import InvalidKnob
from redbatch.knobs_cli import admin_parser

HELP = ("show or change a model's versions: the traffic split by weight, the latest "
        "version, draining one (its workers stop once its queue is empty)")


def register(sub: Any) -> argparse.ArgumentParser:
    parser = admin_parser(sub, "versions", HELP, "VERSION=WEIGHT",
                          "each version's share of the requests that pin none (1=95 2=5); "
                          "0 takes a version out of the split")
    parser.add_argument("--latest", help="pin the latest version ('' unpins it: the "
                                         "highest version)")
    parser.add_argument("--drain", metavar="VERSION", help="drain a version")
    parser.add_argument("--undrain", metavar="VERSION", help="take a drain back")
    return parser


def parse_weights(pairs: list[str]) -> dict[str, float]:
    """``VERSION=WEIGHT`` words, checked (``versions.check_weight``)."""
    weights: dict[str, float] = {}
    for pair in pairs:
        version, sep, text = pair.partition("=")
        try:
            value = orjson.loads(text) if sep and version else None
        except orjson.JSONDecodeError:
            value = None
        if value is None:
            raise InvalidKnob(f"expected VERSION=WEIGHT (a number), got {pair!r}")
        weights[version] = versions.check_weight(version, value)
    return weights


async def _run(redis: RedisSettings, model: str, changes: dict[str, Any]) -> dict[str, Any]:
    from redbatch.redis_conn import async_client, translated  # not for --help

    client = async_client(redis)
    try:
        async with translated(redis):
            table = None
            if changes["weights"] or any(changes[k] is not None
                                         for k in ("latest", "drain", "undrain")):
                table = await versions.change(client, model, **changes)
            return await versions.describe(client, model, table)
    finally:
        await client.aclose()


def render(answer: dict[str, Any]) -> str:
    """One version a line: weight, share, flags and live workers."""
    lines = [f"model {answer['model']}  latest {answer['latest']}"]
    for row in answer["versions"]:
        flags = " ".join(f for f in ("latest", "draining") if row[f])
        weight = "-" if row["weight"] is None else f"{row['weight']:g}"
        lines.append(f"  {row['version']:<10} weight {weight:<8} share {row['share']:>6.1%}  "
                     f"live {row['live_workers']:<3} {flags}".rstrip())
    if not answer["versions"]:
        lines.append("  (served without versions)")
    return "\n".join(lines)


def cmd_versions(args: argparse.Namespace, redis: RedisSettings) -> int:
    changes = {"weights": parse_weights(args.changes), "latest": args.latest,
               "drain": args.drain, "undrain": args.undrain}
    answer = asyncio.run(_run(redis, args.model, changes))
    print(orjson.dumps(answer).decode() if args.json else render(answer))
    return 0
