"""The naive baseline of the benchmarks: FastAPI + uvicorn, one process, the model
called inline per request (no batching).

POST /w1 -> {"y": x};  POST /w2 -> {"y": mlp([x])[0]};
POST /w3 {"input_ids", "attention_mask"} -> {"logits": textcls(one body)[0]} (batch 1,
no padding; the bench runs W3 with ``uvicorn --workers 2``);
POST /w3served: the same through the forward the demo model ``textcls`` serves
(``build_served``: the attention path chosen by length), batch 1 as well
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from pydantic import BaseModel

from redbatch.bench.mlp import build_mlp
from redbatch.bench.textcls import build_served, build_textcls

torch.set_num_threads(1)
MODEL = build_mlp().eval()
TEXTCLS = build_textcls()
SERVED = build_served()
app = FastAPI()


class Inp(BaseModel):
    x: list[float]


class TextInp(BaseModel):
    input_ids: list[int]
    attention_mask: list[int]


@app.post("/w1")
async def w1(inp: Inp) -> dict[str, list[float]]:
    return {"y": inp.x}


@app.post("/w2")
async def w2(inp: Inp) -> dict[str, list[float]]:
    with torch.inference_mode():
        out: list[float] = MODEL(torch.tensor([inp.x], dtype=torch.float32)).tolist()[0]
    return {"y": out}


@app.post("/w3")
async def w3(inp: TextInp) -> dict[str, list[float]]:
    return {"logits": _classify(TEXTCLS, inp)}


@app.post("/w3served")
async def w3served(inp: TextInp) -> dict[str, list[float]]:
    return {"logits": _classify(SERVED, inp)}


def _classify(model: torch.nn.Module, inp: TextInp) -> list[float]:
    with torch.inference_mode():
        ids = torch.tensor([inp.input_ids], dtype=torch.int64)
        lens = torch.tensor([sum(inp.attention_mask)], dtype=torch.int64)
        out: list[float] = model(ids, lens).tolist()[0]
    return out
