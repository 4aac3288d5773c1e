"""Which routed experts a program's tokens choose: a host-side probe, and the router-bias balancing that a trained
K2.6 has (its e_score_correction_bias).

`ExpertProbe`: pass `ops.Impls(..., probe=ExpertProbe(E))` and every `ops.moe_gemm` of the compiled program also
sends its layer index and top-k expert ids to the probe through `jax.debug.callback` (a measurement build: the
normal build has no callback). After the program, `jax.effects_barrier()`, then `loads()` / `touched()`.

`balance_bias`: DeepSeek-V3's auxiliary-loss-free update, bias_e += step * sign(mean load - load_e) per layer,
repeated over one calibration batch with a shrinking step, so that random weights route as evenly as a trained
router does (a random router crowds its tokens onto a few experts, which makes a step read fewer expert bytes
than a real one).
"""

from __future__ import annotations

import threading

import jax
import numpy as np


class ExpertProbe:
    """Host record of (layer, top-k ids) per MoE call (module docstring). Hashable by identity (a static jit
    argument through Impls)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.calls: list[tuple[int, np.ndarray]] = []
        self.lock = threading.Lock()

    def record(self, layer, topk_ids):
        with self.lock:
            self.calls.append((int(layer), np.asarray(topk_ids)))

    def clear(self):
        jax.effects_barrier()
        with self.lock:
            self.calls = []

    def _collected(self) -> list[tuple[int, np.ndarray]]:
        jax.effects_barrier()
        with self.lock:
            return list(self.calls)

    def loads(self, num_layers: int) -> np.ndarray:
        """Tokens sent to each expert per MoE layer, [num_layers, E], summed over the calls so far."""
        out = np.zeros((num_layers, self.num_experts), np.int64)
        for layer, ids in self._collected():
            out[layer] += np.bincount(_routed(ids), minlength=self.num_experts)
        return out

    def touched(self, shards: int = 1) -> dict:
        """Per call (one MoE layer of one program run): distinct experts touched, and the most on one of `shards`
        equal expert shards, and on the first shard (device 0's experts); their means over the calls."""
        per_call, busiest, first = [], [], []
        for _, ids in self._collected():
            hit = np.zeros(self.num_experts, bool)
            hit[_routed(ids)] = True
            per_call.append(int(hit.sum()))
            busiest.append(int(hit.reshape(shards, -1).sum(1).max()))
            first.append(int(hit.reshape(shards, -1)[0].sum()))
        if not per_call:
            raise ValueError("the probe recorded no MoE call: was the program compiled with Impls(probe=...)?")
        return {
            "calls": len(per_call),
            "mean": float(np.mean(per_call)),
            "busiest_shard": float(np.mean(busiest)),
            "first_shard": float(np.mean(first)),
        }


def _routed(ids) -> np.ndarray:
    """The expert ids of a call that went to an expert (a finished slot's tokens carry -1: routed nowhere)."""
    ids = ids.ravel()
    return ids[ids >= 0]


def imbalance(loads_LE: np.ndarray) -> float:
    """The busiest expert's load over the mean, averaged over layers (1 = perfectly even)."""
    loads = np.asarray(loads_LE, np.float64)
    return float(np.mean(loads.max(1) / np.maximum(loads.mean(1), 1e-9)))


def balance_bias(loads_fn, bias_LE: np.ndarray, iters: int = 40, step: float = 0.02, decay: float = 0.93):
    """Router bias [L, E] after `iters` sign updates against loads_fn(bias) -> loads [L, E]; (bias, imbalance
    before, imbalance after)."""
    bias = np.asarray(bias_LE, np.float32).copy()
    loads = loads_fn(bias)
    before = imbalance(loads)
    for i in range(iters):
        mean = loads.mean(1, keepdims=True)
        bias += np.float32(step * decay**i) * np.sign(mean - loads).astype(np.float32)
        loads = loads_fn(bias)
    return bias, before, imbalance(loads)
