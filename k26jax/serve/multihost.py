"""The server over several processes (multi-controller JAX): HTTP and the scheduler on process 0, followers elsewhere.

Every process must run the same device programs in the same order. Process 0's scheduler calls its decoder through
`Leader`, which first publishes each call (an insert with its prompt and sampling values, a step with the chosen
budget candidate, a fresh state, compile and warm-up for budget="auto", stop) under one key per call in jax's
distributed key-value store (`distributed.broadcast_bytes`); `follow` on every other process reads the calls in
order and makes the same ones on its own copy of the decode state. Host reads stay on process 0 (the emission
arrays are replicated). Keys are deleted a few calls later: a follower cannot lag further, since every step holds
collectives with it. A dead process stops the others through the coordination service's heartbeat.
"""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np

from k26jax import distributed
from k26jax.serve.scheduler import insert_args

log = logging.getLogger("k26jax.serve")
KEEP = 8  # calls whose keys stay published


def _key(n: int) -> str:
    return f"serve/{n}"


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else jnp.dtype(dtype).name


class Leader:
    """Process 0's decoder: each device call is published before it is made (module docstring). Everything else
    (sc, cfg, candidates, observe, ...) is the wrapped decoder's."""

    def __init__(self, dec):
        self.dec, self.calls = dec, 0

    def __getattr__(self, name):
        return getattr(self.dec, name)

    def _publish(self, *call):
        distributed.broadcast_bytes(json.dumps(call).encode(), _key(self.calls))
        if self.calls >= KEEP:
            distributed.forget(_key(self.calls - KEEP))
        self.calls += 1

    def empty(self, *, batch, max_len, dtype, ctx_dtype=None):
        self._publish("empty", batch, max_len, _dtype_name(dtype), _dtype_name(ctx_dtype))
        return self.dec.empty(batch=batch, max_len=max_len, dtype=dtype, ctx_dtype=ctx_dtype)

    def insert(self, params, dparams, state, *args):
        self._publish("insert", [np.asarray(a).tolist() for a in args])
        return self.dec.insert(params, dparams, state, *args)

    def step(self, params, dparams, state):
        self._publish("step", getattr(self.dec, "choice", 0), getattr(self.dec, "fresh", True))
        return self.dec.step(params, dparams, state)

    def prepare(self, params, dparams, state, progress=None):
        self._publish("prepare")
        return self.dec.prepare(params, dparams, state, progress=progress)

    def warm(self, params, dparams, state):
        self._publish("warm")
        return self.dec.warm(params, dparams, state)

    def stop(self):
        self._publish("stop")


def follow(dec, params, dparams) -> int:
    """A follower's loop: make process 0's published calls in order until "stop"; 0 then."""
    state, n = None, 0
    while True:
        try:
            call = json.loads(distributed.broadcast_bytes(None, _key(n)))
        except TimeoutError:  # process 0 is idle (a dead one ends this process through the heartbeat)
            continue
        n += 1
        kind, args = call[0], call[1:]
        try:
            if kind == "stop":
                log.info("process 0 stopped the server")
                return 0
            if kind == "empty":
                batch, max_len, dtype, ctx_dtype = args
                state = None  # free the old state first, as process 0 does
                ctx_dtype = None if ctx_dtype is None else jnp.dtype(ctx_dtype)
                state = dec.empty(batch=batch, max_len=max_len, dtype=jnp.dtype(dtype), ctx_dtype=ctx_dtype)
            elif kind == "insert":  # the values scheduler.insert_args made, in Decoder.insert's order
                slot, ids, length, seed, temperature, top_p, max_new = args[0]
                values = insert_args(slot, np.asarray(ids, np.int32), length, max_new, temperature, top_p, seed)
                state = dec.insert(params, dparams, state, *values)
            elif kind == "step":
                if hasattr(dec, "choice"):
                    dec.choice, dec.fresh = args
                state = dec.step(params, dparams, state)
            elif kind == "prepare":
                dec.prepare(params, dparams, state)
            elif kind == "warm":
                state = dec.warm(params, dparams, state)
        except Exception as error:  # noqa: BLE001 -- process 0 meets the same fault and publishes a fresh state
            log.error("call %d (%s) failed: %s: %s", n - 1, kind, type(error).__name__, error)
