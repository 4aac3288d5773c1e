"""The engine thread's warm-up leaves nothing to compile while serving, also where the parameters are committed
to a device (a balanced router bias, a sharded load): a step's outputs are then committed and a fresh state is
not, and jit compiles an insert for each."""

import os
import threading

import jax

import k26jax
from k26jax import engine
from k26jax.serve import scheduler

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny")


def test_serving_with_committed_parameters_compiles_no_insert_after_the_warm_up():
    """(Uncommitted parameters, a loaded checkpoint's, are every server test's: tests/test_server.py checks that
    the compile count stays flat there.)"""
    model = k26jax.load(TINY, dtype="float32")
    params, dparams = jax.device_put((model.params, model.drafter_params), jax.devices()[0])
    sc = engine.StepConfig(method="ddtree", budget=4, max_new_tokens=16, sampling=True)
    dec = engine.Decoder(model.cfg, model.drafter_cfg, sc, model.impls)
    sched = scheduler.Scheduler(dec, params, dparams, max_batch=2, max_len=32, max_queue=8)
    sched.warm_up()
    insert = dec._programs["insert"]
    compiled = insert._cache_size()
    finished = threading.Semaphore(0)
    sink = lambda event: finished.release() if isinstance(event, tuple) else None
    sched.start()
    try:
        for i, n in enumerate((5, 20, 9, 12)):  # both buckets (16, 32), fresh and reused slots
            sched.submit(scheduler.Request(list(range(3, 3 + n)), 6, 0.0, 1.0, i, sink))
        assert all(finished.acquire(timeout=120) for _ in range(4))
    finally:
        sched.stop()
    assert insert._cache_size() == compiled
