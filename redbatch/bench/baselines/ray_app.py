"""Ray Serve for ``redbatch bench --ray PYTHON``: a reference
setup (local Ray with num_cpus=2, Serve's HTTP proxy, one replica each) serving
W1 at ``/w1`` (a no-op deployment) and W2 at ``/w2`` (``@serve.batch(32, 5 ms)`` over
the same MLP as redbatch's demo), and W3 at ``/w3`` (``@serve.batch(32, 5 ms)`` over
the text classifier, each batch zero-padded to its longest body).  Run by the Python
that has ``ray[serve]`` and torch, as a plain script: it imports nothing from redbatch
but ``../mlp.py`` and ``../textcls.py``.
Prints READY when serving; stops on SIGTERM.
"""

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve
from starlette.requests import Request

PORT = int(os.environ.get("RAY_BENCH_PORT", "18002"))
NOLOG = {"enable_access_log": False}
# A replica asks for one CPU by default: three would not fit in num_cpus=2, and W3's
# would never be scheduled.  They are measured one at a time, so each asks for half.
REPLICA = {"num_cpus": 0.5}
HERE = str(Path(__file__).resolve().parent.parent)  # holds mlp.py, textcls.py


@serve.deployment(max_ongoing_requests=64, logging_config=NOLOG, ray_actor_options=REPLICA)
class Noop:
    async def __call__(self, request: Request) -> dict[str, Any]:
        return {"y": (await request.json())["x"]}


@serve.deployment(max_ongoing_requests=64, logging_config=NOLOG, ray_actor_options=REPLICA)
class Batched:
    def __init__(self) -> None:
        import mlp  # type: ignore[import-not-found]  # redbatch/bench/mlp.py, via PYTHONPATH

        torch.set_num_threads(1)
        self.model = mlp.build_mlp().eval()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def infer(self, xs: list[Any]) -> list[Any]:
        with torch.inference_mode():
            out: list[Any] = self.model(torch.tensor(xs, dtype=torch.float32)).tolist()
        return out

    async def __call__(self, request: Request) -> dict[str, Any]:
        return {"y": await self.infer((await request.json())["x"])}


@serve.deployment(max_ongoing_requests=64, logging_config=NOLOG, ray_actor_options=REPLICA)
class Text:
    def __init__(self) -> None:
        import textcls  # type: ignore[import-not-found]  # redbatch/bench/textcls.py

        torch.set_num_threads(1)
        self.model = textcls.build_textcls()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def infer(self, bodies: list[Any]) -> list[Any]:
        longest = max(len(b["input_ids"]) for b in bodies)
        ids = [b["input_ids"] + [0] * (longest - len(b["input_ids"])) for b in bodies]
        lens = [sum(b["attention_mask"]) for b in bodies]
        with torch.inference_mode():
            out: list[Any] = self.model(torch.tensor(ids, dtype=torch.int64),
                                        torch.tensor(lens, dtype=torch.int64)).tolist()
        return out

    async def __call__(self, request: Request) -> dict[str, Any]:
        return {"logits": await self.infer(await request.json())}


def main() -> None:
    stop = {"flag": False}
    sys.path.insert(0, HERE)
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": HERE}})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT}, logging_config=NOLOG)
    serve.run(Noop.bind(),  # type: ignore[attr-defined]
              name="w1", route_prefix="/w1", logging_config=NOLOG)
    serve.run(Batched.bind(),  # type: ignore[attr-defined]
              name="w2", route_prefix="/w2", logging_config=NOLOG)
    serve.run(Text.bind(),  # type: ignore[attr-defined]
              name="w3", route_prefix="/w3", logging_config=NOLOG)
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    print(f"READY port={PORT} ray={ray.__version__}", flush=True)
    while not stop["flag"]:
        time.sleep(0.2)
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
