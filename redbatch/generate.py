"""``generate``: the streaming demo model, a tiny character-level torch model.

An embedding, a GRU cell and a linear head over the 95 printable ASCII characters,
with seeded random weights (nothing is downloaded or trained: its text is gibberish,
the same for the same prompt), decoding greedily one character per step.  Input
``{"prompt": "hello", "max_tokens": 16}`` (``text_input`` for ``prompt`` too, as
Triton's generate extension names it); one chunk per character.

The batch function is a continuous-batching generator (``StreamBatch``): requests
join at any step (their prompts run through the GRU first), each step advances
every member by one character in one batched pass, and a member that has its
``max_tokens`` ends with ``STOP``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from redbatch import defaults
from redbatch.worker.model import BatchFn, Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.stream_batch import STOP, StreamBatch

FIRST, VOCAB = 32, 95  # printable ASCII
EMBED, HIDDEN = 32, 128
MAX_TOKENS, DEFAULT_TOKENS, MAX_PROMPT = 512, 16, 1024
SEED = 0


@dataclass
class _Seq:
    hidden: Any  # (1, HIDDEN)
    token: int  # the next character's index
    left: int  # characters still to emit


def _ids(text: str) -> list[int]:
    return [min(max(ord(c) - FIRST, 0), VOCAB - 1) for c in text[:MAX_PROMPT]] or [0]


def request_fields(value: Any) -> tuple[str, int]:
    """The prompt and max_tokens of a request (lenient: a bad value takes a default)."""
    data = value if isinstance(value, dict) else {"prompt": value}
    prompt = data.get("prompt", data.get("text_input", ""))
    tokens = data.get("max_tokens", DEFAULT_TOKENS)
    tokens = tokens if type(tokens) is int else DEFAULT_TOKENS
    return str(prompt), min(max(tokens, 1), MAX_TOKENS)


class CharGRU:
    """The network, with a prefill (one prompt) and a batched one-character step."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        generator = torch.Generator().manual_seed(SEED)
        self.torch, self.device = torch, device
        self.embed = torch.randn(VOCAB, EMBED, generator=generator).to(device)
        self.cell = torch.nn.GRUCell(EMBED, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            for param in [*self.cell.parameters(), *self.head.parameters()]:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        self.cell.to(device).eval()
        self.head.to(device).eval()

    def prefill(self, prompt: str, left: int) -> _Seq:
        torch = self.torch
        with torch.inference_mode():
            hidden = torch.zeros(1, HIDDEN, device=self.device)
            ids = torch.tensor(_ids(prompt), device=self.device)
            for x in self.embed[ids]:
                hidden = self.cell(x[None], hidden)
            token = int(self.head(hidden).argmax(-1))
        return _Seq(hidden, token, left)

    def step(self, seqs: list[_Seq]) -> None:
        """Feed each sequence its next character; greedy choice of the one after."""
        torch = self.torch
        with torch.inference_mode():
            tokens = torch.tensor([s.token for s in seqs], device=self.device)
            hidden = self.cell(self.embed[tokens], torch.cat([s.hidden for s in seqs]))
            nxt = self.head(hidden).argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            seq.hidden, seq.token = hidden[i:i + 1], nxt[i]


def generator_fn(net: CharGRU, step_s: float = 0.0) -> BatchFn:
    """The batch function; ``step_s`` (benchmarks) adds that much to every step, as an
    accelerator's pass would whatever the batch's size."""
    def generate(batch: StreamBatch) -> Iterator[list[Any]]:
        seqs: dict[str, _Seq] = {}
        while len(batch):
            for key, value in batch.joined():
                seqs[key] = net.prefill(*request_fields(value))
            keys = batch.keys
            for gone in seqs.keys() - set(keys):
                del seqs[gone]
            out, live = _emit([seqs[key] for key in keys])
            if live:
                net.step(live)
            if step_s:
                time.sleep(step_s)
            yield out

    return generate


def _emit(seqs: list[_Seq]) -> tuple[list[Any], list[_Seq]]:
    """Each member's character this step (``STOP`` once it has them all)."""
    out: list[Any] = []
    live: list[_Seq] = []
    for seq in seqs:
        if seq.left <= 0:
            out.append(STOP)
            continue
        out.append(chr(FIRST + seq.token))
        seq.left -= 1
        live.append(seq)
    return out, live


def generate_model(name: str = "generate",
                   max_batch_size: int = defaults.GENERATE_MAX_BATCH_SIZE,
                   continuous: bool = True, step_ms: float = 0.0) -> Model:
    """The demo model (``continuous=False``: run-to-completion batches, to compare;
    ``step_ms``: see ``generator_fn``)."""
    def load(device: str) -> BatchFn:
        return generator_fn(CharGRU(device), step_ms / 1000)

    return Model(name, loader=load, streaming=True, continuous=continuous,
                 policy=BatchPolicy(max_batch_size=max_batch_size, batch_wait_timeout_s=0.002),
                 input_name="prompt", output_name="text")
