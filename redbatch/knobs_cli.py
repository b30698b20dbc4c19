"""``redbatch config MODEL [KNOB=VALUE ...] [--reset]``: show or change a model's live
batching knobs (``redbatch.knobs``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import orjson

from redbatch import knobs
from redbatch.config import RedisSettings
from redbatch.errors import InvalidKnob

HELP = ("show or change a model's batching knobs live: every worker of the model "
        "applies them within 2 s, and they outlive worker restarts")


def register(sub: Any) -> argparse.ArgumentParser:
    parser = admin_parser(sub, "config", HELP, "KNOB=VALUE",
                          "values as JSON (16, 0.01, true); KNOB= drops the override. "
                          f"Knobs: {', '.join(knobs.KNOBS)}")
    parser.add_argument("--reset", action="store_true",
                        help="drop every override first (back to the model's own values)")
    return parser


def admin_parser(sub: Any, name: str, text: str, metavar: str, words: str
                 ) -> argparse.ArgumentParser:
    """An admin command's parser: ``MODEL [WORD ...] [--json]`` (``redbatch config``,
    ``redbatch versions``); the changes land in ``args.changes``."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    parser.add_argument("model", help="the model's name")
    parser.add_argument("changes", nargs="*", metavar=metavar, help=words)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    return parser


def parse_changes(pairs: list[str]) -> dict[str, Any]:
    """``KNOB=VALUE`` words: the value as JSON (a bare word stays a string), empty:
    None (drop the override)."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise InvalidKnob(f"expected KNOB=VALUE, got {pair!r}")
        changes[name] = None if text == "" else _value(text)
    return changes


def _value(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


async def _run(redis: RedisSettings, model: str, changes: dict[str, Any], reset: bool
               ) -> dict[str, Any]:
    from redbatch.redis_conn import async_client, translated  # not for --help

    client = async_client(redis)
    try:
        async with translated(redis):
            if not changes and not reset:
                return await knobs.show(client, model)
            return await knobs.configure(client, model, changes, reset=reset)
    finally:
        await client.aclose()


def render(model: str, answer: dict[str, Any]) -> str:
    """The effective values, one knob a line, those overridden marked."""
    lines = [f"model {model}"]
    for name, value in answer["effective"].items():
        mark = "  (override)" if name in answer["overrides"] else ""
        lines.append(f"  {name:<22} {orjson.dumps(value).decode()}{mark}")
    return "\n".join(lines)


def cmd_config(args: argparse.Namespace, redis: RedisSettings) -> int:
    answer = asyncio.run(_run(redis, args.model, parse_changes(args.changes), args.reset))
    print(orjson.dumps(answer).decode() if args.json else render(args.model, answer))
    return 0
