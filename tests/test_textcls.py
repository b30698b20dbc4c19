"""The W3 text classifier (``textcls``, a demo model): the anchors' weights and bodies,
its logits equal at batch 1 and in a padded pass, and the bench's W3 bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from redbatch.bench import textcls
from redbatch.demo import models
from redbatch.worker.ragged import pad_batch

# The anchors' reference (their model_def.py, ``predict_w3`` at batch 1, torch 2.13 CPU)
# for bodies 0, 20, 21 and 33 (11, 8, 458 and 385 tokens).
REFERENCE = {
    0: [0.13978704810142517, -0.2621540427207947, -0.12176878750324249, 0.023407330736517906],
    20: [-0.252697616815567, 0.18294835090637207, 0.239775151014328, -0.1835256665945053],
    21: [-0.1641741544008255, -0.1679287552833557, -0.013518150895833969,
         -0.11834845691919327],
    33: [-0.14167222380638123, -0.22461892664432526, -0.020958777517080307,
         -0.02255719155073166],
}


def logits_batch1(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.tensor([len(ids)])).numpy()[0]


def test_the_bodies_are_the_anchors() -> None:
    lengths = textcls.lengths()
    assert len(lengths) == 64 and min(lengths) == 8 and max(lengths) == 458
    assert sum(lengths) == 7167  # mean 111.98
    bodies = textcls.bodies()
    assert bodies[1]["input_ids"][:3] == [7919, 7950, 7981]
    assert all(b["attention_mask"] == [1] * len(b["input_ids"]) for b in bodies)


def test_logits_equal_the_anchors_reference() -> None:
    model, bodies = textcls.build_textcls(), textcls.bodies()
    for i, want in REFERENCE.items():
        np.testing.assert_allclose(logits_batch1(model, bodies[i]["input_ids"]), want,
                                   atol=1e-4)


# served: fast path batched / attention written out, batched / row by row
@pytest.mark.parametrize("length", [64, 256, 512])
@pytest.mark.parametrize("build", [textcls.build_textcls, textcls.build_served])
def test_a_padded_pass_gives_each_body_its_batch1_logits(build: Callable[[], Any],
                                                         length: int) -> None:
    model, reference = build(), textcls.build_textcls()
    bodies = [b for b in textcls.bodies() if len(b["input_ids"]) <= length]
    rows = [np.asarray(b["input_ids"], dtype=np.int64) for b in bodies]
    padded, lengths = pad_batch(rows, length, 0)
    with torch.inference_mode():
        got = model(torch.from_numpy(padded), torch.from_numpy(lengths)).numpy()
    want = np.stack([logits_batch1(reference, b["input_ids"]) for b in bodies])
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_textcls_is_a_demo_model_over_token_ids() -> None:
    (model,) = [m for m in models() if m.name == "textcls"]
    assert model.input_name == "input_ids" and model.output_name == "logits"
    assert model.spec is not None and model.spec.max_len == 512
    assert model.output_spec is None  # pooled: the 4 logits come back whole
