"""serve/metrics: one jax compile listener for the process feeds every live Metrics, and /metrics' auto gauges."""

import gc
import weakref

import jax
import jax.numpy as jnp

from k26jax import autobudget, budget
from k26jax.serve.metrics import Metrics


def test_each_live_metrics_counts_each_compile_once():
    first, second = Metrics(), Metrics()
    before = first.compiled, second.compiled
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()  # a program never compiled before
    assert first.compiled - before[0] == second.compiled - before[1] >= 1
    gone = weakref.ref(second)
    del second
    gc.collect()
    assert gone() is None  # jax keeps its listeners forever: a Metrics must not be held by one
    third = Metrics()
    base = first.compiled, third.compiled
    jax.jit(lambda x: x * 5 - 2)(jnp.arange(9.0)).block_until_ready()
    assert first.compiled - base[0] == third.compiled - base[1] >= 1  # one listener: no double counting


def test_budget_step_exports_choices_times_and_calibration():
    m = Metrics()
    pol = autobudget.Policy(budget.CANDIDATES)
    pol.seconds[3], pol.gamma = 0.0125, 1.7
    m.budget_step("ddtree32", pol)
    m.budget_step("ddtree32", pol)
    text = m.render().decode()
    assert 'k26jax_budget_choices_total{candidate="ddtree32"} 2.0' in text
    assert 'k26jax_budget_step_ms{candidate="ddtree32"} 12.5' in text
    assert "k26jax_budget_calibration_gamma 1.7" in text
