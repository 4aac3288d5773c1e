"""Prometheus metrics of a server (its own registry, served at /metrics).

Compilations are counted from JAX's backend-compile events, so any recompile in the process shows, not only
those of the programs the scheduler knows about (one listener for the process, fanned out to the live Metrics).
"""

from __future__ import annotations

import functools
import weakref

import prometheus_client as prom
from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
OUTCOMES = ("stop", "length", "cancelled", "error", "shutdown", "rejected", "overloaded")


def _doubling(start: float, n: int) -> list[float]:
    return [start * 2**i for i in range(n)]


class Metrics:
    def __init__(self, max_depth: int = 8):
        prom.disable_created_metrics()
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter("k26jax_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = prom.Counter("k26jax_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = prom.Counter("k26jax_generation_tokens", "Tokens generated", registry=r)
        self.accept_length = prom.Histogram(
            "k26jax_accept_length",
            "Tokens a slot received from one step (tau: target passes per token saved)",
            buckets=[i + 0.5 for i in range(1, max_depth + 1)],
            registry=r,
        )
        self.step_seconds = prom.Histogram(
            "k26jax_step_seconds",
            "One decode step, dispatch to emissions on the host",
            buckets=_doubling(1e-4, 20),
            registry=r,
        )
        self.insert_seconds = prom.Histogram(
            "k26jax_insert_seconds",
            "Prefill and insert of one prompt between steps (the other slots wait this long)",
            ["bucket"],
            buckets=_doubling(1e-3, 16),
            registry=r,
        )
        self.ttft_seconds = prom.Histogram(
            "k26jax_time_to_first_token_seconds",
            "Submit to first token",
            buckets=_doubling(1e-3, 18),
            registry=r,
        )
        self.engine_seconds = prom.Counter(
            "k26jax_engine_seconds",
            "The engine thread's time: host work, waiting on the device's emissions, idle (no request)",
            ["activity"],
            registry=r,
        )
        for activity in ("host", "device_wait", "idle"):
            self.engine_seconds.labels(activity)
        self.queue_depth = prom.Gauge("k26jax_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_in_use = prom.Gauge("k26jax_slots_in_use", "Slots holding a request", registry=r)
        self.compilations = prom.Counter("k26jax_compilations", "XLA compilations in this process", registry=r)
        self.budget_choices = prom.Counter(
            "k26jax_budget_choices", "Steps run per candidate (--budget auto)", ["candidate"], registry=r
        )
        self.budget_step_ms = prom.Gauge(
            "k26jax_budget_step_ms", "Measured step time per candidate (--budget auto)", ["candidate"], registry=r
        )
        self.calibration_gamma = prom.Gauge(
            "k26jax_budget_calibration_gamma", "Drafter calibration g(S) = S^gamma (--budget auto)", registry=r
        )
        self.compiled = 0
        _LIVE.add(self)
        _listen()

    def compiled_one(self):
        self.compiled += 1
        self.compilations.inc()

    # ---- called by the scheduler and the app ------------------------------------------------------------------
    def finished(self, outcome: str):
        self.requests.labels(outcome).inc()

    def queue(self, n: int):
        self.queue_depth.set(n)

    def slots(self, n: int):
        self.slots_in_use.set(n)

    def inserted(self, bucket: int, seconds: float, prompt_tokens: int):
        self.insert_seconds.labels(str(bucket)).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float):
        self.ttft_seconds.observe(seconds)

    def step(self, seconds: float):
        self.step_seconds.observe(seconds)

    def engine(self, activity: str, seconds: float):
        self.engine_seconds.labels(activity).inc(seconds)

    def accepted(self, n: int):
        if n:
            self.accept_length.observe(n)

    def tokens(self, n: int):
        self.generation_tokens.inc(n)

    def budget_step(self, ran: str, policy):
        """A --budget auto step ran candidate `ran`; the policy's measured times and calibration."""
        self.budget_choices.labels(ran).inc()
        for name, ms in policy.stats()["step_ms"].items():
            self.budget_step_ms.labels(name).set(ms)
        self.calibration_gamma.set(policy.gamma)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _on_event(event: str, duration: float, **_):
    if event == COMPILE_EVENT:
        for m in list(_LIVE):
            m.compiled_one()


@functools.cache
def _listen():
    """Register the process's one compile listener (jax keeps listeners for the life of the process)."""
    monitoring.register_event_duration_secs_listener(_on_event)
