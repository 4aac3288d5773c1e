"""The engine thread: a fixed batch of slots, continuous batching between compiled steps.

One thread owns the device. Each turn of its loop, on the host:
  1. frees the slots whose request was cancelled (a client gone, a stop string matched);
  2. inserts waiting requests into free slots (`Decoder.insert`: a jitted prefill of one bucketed prompt into
     slot i of the donated state) and delivers each first token;
  3. dispatches one step (`Decoder.step`, state donated) for all slots;
  4. delivers the previous step's tokens while this one runs on the device (a one-step pipeline), then copies
     this step's emission arrays (a few KB) to the host. With --budget auto (`autobudget.AutoDecoder`) they
     carry the candidates' tree survival too (new on its estimating steps, one in `ESTIMATE_EVERY`), and the
     step's time and outcome pick the next step's budget.
A slot whose request finished on the device (EOS, its token limit) is freed when its last tokens are delivered.
A slot the host freed may go on decoding on the device until it is reused: its tokens are dropped, and its
sampling values and limit are its own, so no other slot sees them.

Nothing a request does may stop the thread: an exception in a step or an insert fails the requests in the batch
(their caches went with the donated state), a fresh empty state replaces it, and the loop goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Callable

import jax
import numpy as np

from k26jax import autobudget, engine
from k26jax.serve.metrics import Metrics

log = logging.getLogger("k26jax.serve")

FAULT_ENV = "K26JAX_SERVE_FAULT_STEPS"  # test seam: comma-separated step numbers (0 = first served step) that raise
MIN_BUCKET = 16
EMISSION_FIELDS = ("emitted", "num_emitted", "done", "logprob", "top_ids", "top_logprob")


class QueueFull(Exception):
    """The waiting queue is at max_queue (HTTP 503)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests, or ran out of time for this one (HTTP 503)."""


class StepFault(Exception):
    """A step or insert raised; the request's state is lost (HTTP 500)."""


def buckets(max_len: int) -> list[int]:
    """Prompt lengths insert is compiled for: powers of two from MIN_BUCKET, then max_len."""
    out, b = [], MIN_BUCKET
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_for(n: int, max_len: int) -> int:
    return next(b for b in buckets(max_len) if b >= n)


@dataclasses.dataclass
class Emission:
    """Tokens a request received from one insert or step, with their logprobs when the step computes them."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) of the most likely tokens


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to decode. `sink(event)` is called on the engine thread with each Emission, then once with
    ("finished", "stop" | "length") (EOS or the token limit) or ("error", StepFault | Draining)."""

    ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    seed: int
    sink: Callable[[object], None]
    cancelled: str | None = None  # the outcome a host-side stop records ("stop", "cancelled")
    finished: bool = False
    generated: int = 0
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)


class Scheduler:
    """Owns the decode state, the slots and the waiting queue; `start()` runs the engine thread."""

    def __init__(
        self,
        dec: engine.Decoder | autobudget.AutoDecoder,
        params,
        dparams,
        *,
        max_batch: int,
        max_len: int,
        max_queue: int,
        metrics: Metrics | None = None,
    ):
        self.dec, self.params, self.dparams = dec, params, dparams
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.dtype = params["embed"].dtype
        self.ctx_dtype = jax.tree.leaves(dparams)[0].dtype if dparams is not None else None
        self.metrics = metrics or Metrics(dec.sc.depth + 1)
        self.eos_ids = set(dec.sc.eos_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_batch
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.drain_deadline: float | None = None
        self.steps = 0
        self.faults = {int(s) for s in os.environ.get(FAULT_ENV, "").split(",") if s.strip()}
        self.auto = getattr(dec, "auto", False)  # an AutoDecoder, or process 0's Leader over one
        self.fields = EMISSION_FIELDS + (("survival", "realised") if self.auto else ())
        self.fetched = None  # (owners, host emission arrays) of the last step, not yet delivered
        self.waited = 0.0  # of this turn, in _wait
        self.state = self._empty()
        self.thread = threading.Thread(target=self._run, name="k26jax-engine", daemon=True)

    # ---- called from the HTTP side -------------------------------------------------------------------------------
    def submit(self, req: Request):
        with self.lock:
            if self.drain_deadline is not None or self.stopping:
                raise Draining("the server is shutting down")
            if self.thread.ident is not None and not self.thread.is_alive():
                raise Draining("the engine thread has stopped")
            free = sum(r is None for r in self.slots)  # slots the engine thread has yet to fill
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self.waiting.append(req)
            self.metrics.queue(len(self.waiting))
        self.wake.set()

    def cancel(self, req: Request, outcome: str = "cancelled"):
        """Host-side stop (client gone, stop string matched): the engine frees the slot at its next turn."""
        if not req.finished and req.cancelled is None:
            req.cancelled = outcome
            self.wake.set()

    def begin_drain(self, timeout_s: float):
        """Take no new requests; serve those in flight for timeout_s, then fail what is left."""
        with self.lock:
            self.drain_deadline = time.perf_counter() + timeout_s
        self.wake.set()

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def start(self):
        self.thread.start()

    def stop(self, timeout_s: float = 10.0):
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout_s)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def warm_up(self):
        """Compile insert at every prompt bucket and the step (run once each on free slots) before serving.
        Each bucket's insert runs on a fresh state and on one an insert or a step left: where a parameter is
        committed to a device (a balanced router bias, a sharded load) those are committed and a fresh state is
        not, and jit compiles an insert for each."""
        self._insert_every_bucket(fresh=True)
        if self.auto:  # every candidate's step, compiled for this state and run once
            self.dec.prepare(self.params, self.dparams, self.state, progress=log.info)
            self.state = self.dec.warm(self.params, self.dparams, self.state)
        else:
            self.state = self.dec.step(self.params, self.dparams, self.state)
        self._insert_every_bucket(fresh=False)
        jax.block_until_ready(self.state)
        self.state = None  # free the warm-up state before the fresh one is made (two caches may not fit)
        self.state = self._empty()

    def _insert_every_bucket(self, fresh: bool):
        for T in buckets(self.max_len):
            if fresh:
                self.state = None  # freed before the next is made
                self.state = self._empty()
            ids = np.zeros((1, T), np.int32)
            self.state = self.dec.insert(self.params, self.dparams, self.state, *insert_args(0, ids, 1, 1))

    # ---- the engine thread -------------------------------------------------------------------------------------
    def _run(self):
        try:
            while not self.stopping:
                started, self.waited = time.perf_counter(), 0.0
                try:
                    self._turn()
                except Exception as error:  # noqa: BLE001 -- a fault fails the batch, never the thread
                    self._fault(error, list(self.slots))
                self.metrics.engine("host", time.perf_counter() - started - self.waited)
        finally:  # also when recovering from a fault fails: no request is left waiting forever
            self._fail_all(Draining("the server stopped"))

    def _turn(self):
        self._reap()
        if self.drain_deadline is not None and time.perf_counter() > self.drain_deadline:
            self._deliver_fetched()
            self._fail_all(Draining("the server shut down before this request finished"))
        self._admit()
        if not any(r is not None and not self._done_on_device(i, r) for i, r in enumerate(self.slots)):
            if self.fetched is not None:
                self._deliver_fetched()
            else:
                self._wait("idle", lambda: self.wake.wait(0.05))
                self.wake.clear()
            return
        owners = list(self.slots)
        n, self.steps = self.steps, self.steps + 1
        if n in self.faults:
            self._deliver_fetched()
            raise RuntimeError(f"injected fault at step {n} ({FAULT_ENV})")
        started = time.perf_counter()
        self.state = self.dec.step(self.params, self.dparams, self.state)
        self._deliver_fetched()  # host work while the step runs
        self.fetched = (owners, self._fetch())
        self.metrics.step(time.perf_counter() - started)
        if self.auto:
            ran = self.dec.candidates[self.dec.choice]
            self.dec.observe(self.fetched[1], [r is None for r in owners])
            self.metrics.budget_step(autobudget.label(ran), self.dec.policy)

    def _done_on_device(self, slot: int, r: Request) -> bool:
        """Whether the fetched, undelivered step finished r (so r needs no further step)."""
        return self.fetched is not None and self.fetched[0][slot] is r and bool(self.fetched[1]["done"][slot])

    def _fetch(self) -> dict:
        """The state's emission arrays on the host; waits for the step or insert in flight."""
        return self._wait("device_wait", lambda: jax.device_get({f: getattr(self.state, f) for f in self.fields}))

    def _wait(self, activity: str, fn):
        """fn(), its time counted as `activity` rather than host work."""
        started = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - started
        self.waited += seconds
        self.metrics.engine(activity, seconds)
        return out

    def _empty(self):
        return self.dec.empty(batch=self.max_batch, max_len=self.max_len, dtype=self.dtype, ctx_dtype=self.ctx_dtype)

    def _reap(self):
        for i, r in enumerate(self.slots):
            if r is not None and (r.cancelled or r.finished):
                self.slots[i] = None
                if not r.finished:
                    r.finished = True
                    self.metrics.finished(r.cancelled)
        self.metrics.slots(self._in_use())

    def _in_use(self) -> int:
        return sum(r is not None for r in self.slots)

    def _admit(self):
        for i in range(self.max_batch):
            if self.slots[i] is not None:
                continue
            with self.lock:
                while self.waiting and self.waiting[0].cancelled:
                    r = self.waiting.popleft()
                    r.finished = True
                    self.metrics.finished(r.cancelled)
                req = self.waiting.popleft() if self.waiting else None
                self.metrics.queue(len(self.waiting))
            if req is None:
                return
            self._insert(i, req)

    def _insert(self, slot: int, req: Request):
        self.slots[slot] = req  # owned by the slot before anything can fail, so a fault fails it too
        n = len(req.ids)
        T = bucket_for(n, self.max_len)
        ids = np.zeros((1, T), np.int32)
        ids[0, :n] = req.ids
        args = insert_args(slot, ids, n, req.max_new, req.temperature, req.top_p, req.seed)
        started = time.perf_counter()
        self.state = self.dec.insert(self.params, self.dparams, self.state, *args)
        if self.auto:
            self.dec.forget(slot)
        host = self._fetch()
        self.metrics.inserted(T, time.perf_counter() - started, n)
        self.metrics.slots(self._in_use())
        self._deliver_slot(slot, req, host)

    def _deliver_fetched(self):
        if self.fetched is None:
            return
        (owners, host), self.fetched = self.fetched, None
        for i, r in enumerate(owners):
            if r is not None and not r.finished and not r.cancelled:
                self.metrics.accepted(int(host["num_emitted"][i]))
                self._deliver_slot(i, r, host)

    def _deliver_slot(self, i: int, r: Request, host):
        n = int(host["num_emitted"][i])
        if n:
            em = Emission(host["emitted"][i, :n].tolist())
            if host["logprob"].shape[1]:
                em.logprobs = host["logprob"][i, :n].tolist()
                em.top = [
                    list(zip(host["top_ids"][i, j].tolist(), host["top_logprob"][i, j].tolist())) for j in range(n)
                ]
            if not r.generated:
                self.metrics.first_token(time.perf_counter() - r.submitted_at)
            r.generated += n
            self.metrics.tokens(n)
            _send(r, em)
        if host["done"][i]:
            reason = "stop" if n and int(host["emitted"][i, n - 1]) in self.eos_ids else "length"
            r.finished = True
            _send(r, ("finished", reason))
            self.metrics.finished(reason)
            if self.slots[i] is r:
                self.slots[i] = None
                self.metrics.slots(self._in_use())

    def _fault(self, error: Exception, affected):
        log.error("engine fault (%s: %s): failing the batch, resetting the decode state", type(error).__name__, error)
        fault = StepFault(f"the decode step failed: {type(error).__name__}: {error}")
        for r in affected + list(self.slots):
            if r is not None:
                self._fail(r, fault, "error")
        self.slots = [None] * self.max_batch
        self.fetched = None
        self.metrics.slots(0)
        self.state = None  # free the old state (not donated if the fault came first) before making a new one
        self.state = self._empty()

    def _fail(self, r: Request, error: Exception, outcome: str):
        if not r.finished:
            r.finished = True
            _send(r, ("error", error))
            self.metrics.finished(outcome)

    def _fail_all(self, error: Exception):
        with self.lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
            self.metrics.queue(0)
        for r in waiting + [r for r in self.slots if r is not None]:
            self._fail(r, error, "shutdown")
        self.slots = [None] * self.max_batch
        self.metrics.slots(0)


def insert_args(slot: int, ids_1T, length: int, max_new: int, temperature=0.0, top_p=1.0, seed=0):
    """Decoder.insert's arguments after the state, as host scalars of fixed dtypes (no retrace, no compile)."""
    return (
        np.int32(slot),
        ids_1T,
        np.int32(length),
        np.uint32(seed % (1 << 32)),
        np.float32(temperature),
        np.float32(top_p),
        np.int32(max_new),
    )


def _send(r: Request, event):
    """Post to the request's sink; a sink that fails (its event loop gone) cancels the request instead."""
    try:
        r.sink(event)
    except Exception:  # noqa: BLE001
        r.cancelled = r.cancelled or "cancelled"
