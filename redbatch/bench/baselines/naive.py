"""The naive baseline of the benchmarks: FastAPI + uvicorn, one process, the model
called inline per request (no batching).

POST /w1 -> {"y": x};  POST /w2 -> {"y": mlp([x])[0]};
POST /w3 {"input_ids", "attention_mask"} -> {"logits": textcls(one body)[0]} (batch 1,
no padding; the bench runs W3 with ``uvicorn --workers 2``)
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from pydantic import BaseModel

from redbatch.bench.mlp import build_mlp
from redbatch.bench.textcls import build_textcls

torch.set_num_threads(1)
MODEL = build_mlp().eval()
TEXTCLS = build_textcls()
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
    with torch.inference_mode():
        ids = torch.tensor([inp.input_ids], dtype=torch.int64)
        lens = torch.tensor([sum(inp.attention_mask)], dtype=torch.int64)
        out: list[float] = TEXTCLS(ids, lens).tolist()[0]
    return {"logits": out}
