"""Parity with Hugging Face transformers' DeepseekV3ForCausalLM on committed INT4 checkpoints (tests/fixtures)."""

import os

import numpy as np
import pytest

import k26jax

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NAMES = ["parity_k26", "parity_k2_group", "parity_dsv3_norope"]


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    ref = np.load(os.path.join(FIXTURES, request.param + ".npz"))
    return os.path.join(FIXTURES, request.param), ref


def test_float32_logits_and_hidden_states_match_transformers(fixture):
    path, ref = fixture
    model = k26jax.load(path, dtype="float32", drafter=False)
    n = model.cfg.num_hidden_layers
    logits, hidden = model.logits(ref["input_ids"], hidden_layer_ids=tuple(range(n)))
    assert rel_err(logits, ref["logits"]) <= 1e-4
    for layer in range(n - 1):  # HF's hidden_states[i+1] = output of layer i
        assert rel_err(hidden[layer], ref["hidden_states"][layer + 1]) <= 1e-4, layer
    assert rel_err(hidden[n - 1], ref["last_layer_output"]) <= 1e-4


def test_bfloat16_logits_and_greedy_argmax(fixture):
    path, ref = fixture
    logits = np.asarray(k26jax.load(path, dtype="bfloat16", drafter=False).logits(ref["input_ids"]))
    assert rel_err(logits, ref["logits"]) <= 3e-2
    safe = ref["logit_margin"] > 0.05
    np.testing.assert_array_equal(logits.argmax(-1)[safe], ref["logits"].argmax(-1)[safe])
