"""serve/multihost: process 0's Leader publishes every device call, and `follow` makes the same calls in order.

The two sides run in one process here, over an in-memory stand-in for jax's key-value store, with recording
decoders: the protocol itself (inserts with their dtypes, fresh states, the auto candidate of each step, auto's
compile and warm-up, stop, key deletion), fast. tests/test_distributed.py runs the real two-process server."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import distributed
from k26jax.serve import multihost, scheduler


class KV:
    """broadcast_bytes / forget over a dict: process 0 publishes, the follower blocks until a key appears."""

    def __init__(self):
        self.store, self.deleted, self.cond = {}, [], threading.Condition()

    def broadcast(self, payload, key, timeout_s=None):
        with self.cond:
            if payload is not None:
                assert key not in self.store, f"{key} published twice"
                self.store[key] = payload
                self.cond.notify_all()
                return payload
            if not self.cond.wait_for(lambda: key in self.store, timeout=timeout_s or 0.2):
                raise TimeoutError(key)
            return self.store[key]

    def forget(self, key):
        with self.cond:
            self.deleted.append(key)


class Recorder:
    """A decoder that records its calls; its state is the number of calls so far (auto: the candidate too)."""

    auto = True
    FIELDS = ()

    def __init__(self):
        self.calls, self.choice, self.fresh = [], 0, True

    def empty(self, *, batch, max_len, dtype, ctx_dtype=None):
        self.calls.append(("empty", batch, max_len, jnp.dtype(dtype).name, ctx_dtype and jnp.dtype(ctx_dtype).name))
        return len(self.calls)

    def insert(self, params, dparams, state, *args):
        self.calls.append(("insert", state, tuple((np.asarray(a).dtype.name, np.asarray(a).tolist()) for a in args)))
        return len(self.calls)

    def step(self, params, dparams, state):
        self.calls.append(("step", state, self.choice, self.fresh))
        return len(self.calls)

    def prepare(self, params, dparams, state, progress=None):
        self.calls.append(("prepare", state))

    def warm(self, params, dparams, state):
        self.calls.append(("warm", state))
        return len(self.calls)


def test_the_follower_makes_the_leaders_calls_in_order(monkeypatch):
    kv = KV()
    monkeypatch.setattr(distributed, "broadcast_bytes", kv.broadcast)
    monkeypatch.setattr(distributed, "forget", kv.forget)
    lead, follow = Recorder(), Recorder()
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("rc", multihost.follow(follow, None, None)))
    thread.start()
    leader = multihost.Leader(lead)
    state = leader.empty(batch=4, max_len=64, dtype=jnp.bfloat16, ctx_dtype=jnp.float32)
    state = leader.insert(None, None, state, *scheduler.insert_args(2, np.arange(16, dtype=np.int32)[None], 5, 9))
    leader.prepare(None, None, state)
    state = leader.warm(None, None, state)
    for i, choice in enumerate((0, 3, 3, 5, 1, 2, 4, 0, 5)):  # the auto policy's picks reach the follower
        lead.choice, lead.fresh = choice, i % 3 == 0  # with whether the step estimates
        state = leader.step(None, None, state)
    state = leader.insert(None, None, state, *scheduler.insert_args(0, np.ones((1, 32), np.int32), 7, 3, 0.7, 0.9, 11))
    assert leader.FIELDS == () and leader.auto is True  # every other attribute is the decoder's
    leader.stop()
    thread.join(10)
    assert done == {"rc": 0}
    assert follow.calls == lead.calls and len(lead.calls) == 14
    assert kv.deleted == [f"serve/{n}" for n in range(15 - multihost.KEEP)]  # stop is the 15th call


def test_a_failed_call_on_a_follower_does_not_stop_it(monkeypatch):
    kv = KV()
    monkeypatch.setattr(distributed, "broadcast_bytes", kv.broadcast)
    monkeypatch.setattr(distributed, "forget", kv.forget)

    class Flaky(Recorder):
        def step(self, params, dparams, state):
            if len(self.calls) == 1:
                raise RuntimeError("injected")
            return super().step(params, dparams, state)

    lead, follow = Recorder(), Flaky()
    thread = threading.Thread(target=multihost.follow, args=(follow, None, None))
    thread.start()
    leader = multihost.Leader(lead)
    leader.empty(batch=1, max_len=8, dtype=jnp.float32)
    leader.step(None, None, 1)  # the follower's copy raises: logged; process 0 resets with a fresh state
    leader.empty(batch=1, max_len=8, dtype=jnp.float32)
    leader.step(None, None, 3)
    leader.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert [c[0] for c in follow.calls] == ["empty", "empty", "step"]


@pytest.mark.parametrize("call", ["insert", "step"])
def test_the_leader_publishes_before_the_device_call(monkeypatch, call):
    """If the decoder raised before publishing, a follower would wait forever for a call process 0 never made."""
    kv = KV()
    monkeypatch.setattr(distributed, "broadcast_bytes", kv.broadcast)
    monkeypatch.setattr(distributed, "forget", kv.forget)

    class Raises(Recorder):
        def insert(self, *a):
            raise RuntimeError("device")

        def step(self, *a):
            raise RuntimeError("device")

    leader = multihost.Leader(Raises())
    with pytest.raises(RuntimeError, match="device"):
        if call == "insert":
            leader.insert(None, None, 0, *scheduler.insert_args(0, np.ones((1, 16), np.int32), 1, 1))
        else:
            leader.step(None, None, 0)
    assert list(kv.store) == ["serve/0"]
