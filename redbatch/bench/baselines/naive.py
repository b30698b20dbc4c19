"""The naive baseline of the benchmarks: FastAPI + uvicorn, one process, the model
called inline per request (no batching).

POST /w1 -> {"y": x};  POST /w2 -> {"y": mlp([x])[0]}
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from pydantic import BaseModel

from redbatch.bench.mlp import build_mlp

torch.set_num_threads(1)
MODEL = build_mlp().eval()
app = FastAPI()


class Inp(BaseModel):
    x: list[float]


@app.post("/w1")
async def w1(inp: Inp) -> dict[str, list[float]]:
    return {"y": inp.x}


@app.post("/w2")
async def w2(inp: Inp) -> dict[str, list[float]]:
    with torch.inference_mode():
        out: list[float] = MODEL(torch.tensor([inp.x], dtype=torch.float32)).tolist()[0]
    return {"y": out}
