"""budget="auto": each step runs the candidate (chain, or DDTree at a budget) with the most expected tokens a second.

Every candidate's step is compiled with `StepConfig.estimate` = the candidates, so a step also reports, from its
one tree build at the largest budget, the survival S [C, nB, L] of every candidate's tree (k26jax.budget). That
build costs a chain step about 5% (H100), so one step in `estimate_every` estimates and the others run the same
candidate's step compiled with `estimate_stale` (same state, no build). The host reads S with the step's tokens
(the one small transfer a step its loops already make) and runs the next step with argmax_B sum_c E[tau_c](B) /
t(B): the choice is up to estimate_every steps stale and costs no device sync.

t(B) is measured, not modelled: the exponential average of that candidate's step times in this process (dispatch
to its tokens on the host) for this batch and cache size, taken only from non-estimating steps that follow a step
of the same candidate (an estimating step's extra is measured apart: `estimate_ms`). A step that follows another
candidate's may cost more (another executable), so that extra is measured on its own and the policy switches only
when the better rate repays it within `horizon` steps. The choice is stale, so the next steps' expected accept
length is the last estimate shrunk toward its running mean by how well one estimate has predicted the next
(`Policy.rho`; until PREDICT_AFTER estimates, the mean). Each candidate is tried first (a switch step, then two
timed ones), and every `explore_every` steps the least recently timed one is tried again, since the costs move
as contexts grow. Every candidate is lossless, so trying one changes speed, never the tokens at T = 0.

The server's `AutoDecoder` steps one at a time (it schedules between steps). generate's `ChunkedAutoDecoder`
runs a chunk a dispatch: one candidate's estimating step, then its stale steps in a device loop, CHUNK_STEPS in
all. At k26-mini's sub-millisecond steps the host's sync, policy and dispatch (0.5-0.7 ms on an H100 host) were
half of each single step. Every chunk, a trial's too, is that long, so each candidate's time a step carries the
same share of the chunk's fixed costs (chunks of other lengths would make the shorter-run candidates look slow).

Calibration: each estimating step's predicted S_a of the tree it verified is paired with whether that slot's
accept length reached a + 1; every `refit_every` estimates `budget.calibrate` refits g(S) = S^gamma over the pairs
so far (gamma > 1: the drafter is overconfident), and E[tau] = 1 + sum_a g(S_a). One g serves every candidate, but
a drafter can misjudge a tree's alternatives apart from its top-1 path (the mini pair's underrates its trees), so
each candidate's E[tau] is then scaled by what its own steps realised over what they were chosen on
(`Policy.corrections`). A step also tells what the candidates its tree contains would have accepted
(`engine.counterfactual_accept`: smaller DDTree budgets exactly, the chain nearly), so those count too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import re
import time

import numpy as np

from k26jax import budget, engine

CANDIDATES = budget.CANDIDATES
EMA = 0.3  # weight of the newest step time
MAX_PAIRS = 1 << 14  # calibration pairs kept (the newest): a refit over them is ~5 ms of host time
TRIAL = 2  # timed steps a candidate runs when it is tried
MEAN_EMA = 0.05  # weight of the newest estimate in the running E[tau] statistics (1/n before 1/MEAN_EMA of them)
PREDICT_AFTER = 8  # estimates seen before rho is estimated (until then Policy.rho_prior)
CORRECTION_PRIOR = 32  # steps' weight of the prior "the estimate is right" in a candidate's tau correction
ESTIMATE_EVERY = 8  # one step in this many builds the estimate (amortised cost ~0.6% at C = 1, ~1% at C = 8)
CHUNK_STEPS = 32  # ChunkedAutoDecoder: steps a chunk runs (0.5-0.7 ms of host a chunk: ~2% of the mini pair's)
CHUNK_EXPLORE_EVERY = 2048  # steps between retrials of the stalest candidate when chunks are long


def label(candidate) -> str:
    """ "chain" or "ddtree32": a candidate's name in stats and metrics."""
    method, b = candidate
    return method if method == "chain" else f"{method}{b}"


def parse_candidates(text: str) -> tuple:
    """ "chain,ddtree16,ddtree32" -> the candidates auto chooses among (`label`s, comma-separated, at least one)."""
    from pallas_kernels.tree_build import MAX_BUDGET

    out = []
    for name in (n.strip() for n in text.split(",")):
        m = re.fullmatch(r"ddtree(\d+)", name)
        if name == "chain":
            out.append(CANDIDATES[0])
        elif m and 1 <= int(m.group(1)) <= MAX_BUDGET:
            out.append(("ddtree", int(m.group(1))))
        else:
            raise ValueError(f"{name!r}: a candidate is 'chain' or 'ddtreeN' (N in 1..{MAX_BUDGET})")
    if len(set(out)) != len(out):
        raise ValueError(f"{text!r}: a candidate is named twice")
    return tuple(out)


def _ema(old, new):
    return new if old is None else (1 - EMA) * old + EMA * new


@dataclasses.dataclass
class Policy:
    """The host side of budget="auto" for one batch and cache size: step times, calibration, the choice."""

    candidates: tuple
    estimate_every: int = 1  # the AutoDecoder's; above 1 only steps reporting no survival are timed
    chunked: bool = False  # observations are equal chunks: each is timed (seconds None: not) whatever ran before
    trial: int = TRIAL  # timed observations a candidate under trial makes
    explore_every: int = 256
    horizon: int = 64
    refit_every: int = 16  # estimates between refits of the calibration
    rho_prior: float = 0.0  # rho before PREDICT_AFTER estimates: 0 predicts with their mean, 1 with the last
    gamma: float = 1.0
    steps: int = 0
    predicted: list = dataclasses.field(default_factory=list)
    observed: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        n = len(self.candidates)
        self.seconds = [None] * n  # EMA of each candidate's step time after a step of itself (None: not yet)
        self.timed_at = [-1] * n  # the step count when each was last timed
        self.counts = [0] * n  # steps run per candidate
        self.timed = [0] * n  # steps timed per candidate
        self.switch_s = 0.0  # EMA of a switch step's extra seconds over the candidate's own time
        self.estimate_s = None  # EMA of an estimating step's extra seconds (estimate_every > 1; None: not yet)
        self.survival = None  # the last estimate's survival [C, nB, L]
        self.known = None  # [C] bool: the slots whose row of it is their request's (active then, not reused since)
        self.last = None  # the previous step's candidate
        self.last_estimated = False  # whether the previous step ran the candidate's estimating executable
        self.trying = None  # the candidate under trial, until it has TRIAL more timed steps (chunks, when chunked)
        self.trial_until = 0
        self.explored = 0  # explore_every periods whose stalest candidate has been tried
        self.mean, self.prev, self.cov, self.var, self.seen = None, None, 0.0, 0.0, 0  # `_track`
        self.chosen_tau = None  # per-slot E[tau] of each candidate when the next step was chosen
        self.tau_sums = np.zeros((n, 3))  # per candidate run: steps, sum of chosen_tau, sum of realised accept

    def corrections(self) -> np.ndarray:
        """Per candidate, the accept length its steps realised over the E[tau] they were chosen on [nB], shrunk
        toward 1 by CORRECTION_PRIOR steps: the one calibration g cannot make, since a drafter can misjudge a
        tree's alternatives (which a tree's survival sums) apart from its top-1 path (which a chain's is)."""
        n, chosen, realised = self.tau_sums.T
        mean = np.where(n > 0, chosen / np.maximum(n, 1), 1.0)
        return (realised + CORRECTION_PRIOR * mean) / (chosen + CORRECTION_PRIOR * mean)

    def taus(self, survival_CnBL) -> np.ndarray:
        """Calibrated E[tau] [C, nB] from the step's survival."""
        s = np.clip(np.asarray(survival_CnBL, np.float64), 0.0, 1.0)
        return 1.0 + (s**self.gamma).sum(-1)

    @property
    def rho(self) -> float:
        """How much an estimate's E[tau] says about the steps up to the next estimate, in [0, 1]: the
        autocorrelation of consecutive estimates of the largest candidate's per-slot E[tau] (rho_prior until
        PREDICT_AFTER estimates have been seen)."""
        if self.seen < PREDICT_AFTER or self.var <= 0:
            return self.rho_prior
        return float(np.clip(self.cov / self.var, 0.0, 1.0))

    def expected_tokens(self, survival_CnBL, active_C, known_C=None) -> np.ndarray:
        """Expected tokens of the next step per candidate [nB]: the active slots' mean E[tau] from this
        survival, shrunk toward its running mean by rho (the choice is stale: where difficulty does not persist
        from step to step, the last estimate says little about the next steps). known_C: the slots the survival
        speaks for (the others count at the running mean)."""
        active = np.asarray(active_C, bool)
        if not active.any():
            return np.zeros(len(self.candidates))
        x = self.taus(survival_CnBL)
        if known_C is not None and self.mean is not None:
            x = np.where(np.asarray(known_C, bool)[:, None], x, self.mean[None])
        x = x[active].mean(0)
        pred = x if self.mean is None else self.mean + self.rho * (x - self.mean)
        return active.sum() * pred

    def _track(self, survival_CnBL, valid_C) -> bool:
        """Running mean, variance and covariance of consecutive estimates of the per-slot E[tau] (valid slots);
        whether this one counted."""
        valid = np.asarray(valid_C, bool)
        if not valid.any():
            return False
        x = self.taus(survival_CnBL)[valid].mean(0)
        self.seen += 1
        if self.mean is None:
            self.mean, self.prev = x, x
            return True
        w = max(MEAN_EMA, 1 / self.seen)  # a plain mean of the first estimates, then an exponential one
        d, d_prev = x[-1] - self.mean[-1], self.prev[-1] - self.mean[-1]
        self.cov = (1 - w) * self.cov + w * d * d_prev
        self.var = (1 - w) * self.var + w * d * d
        self.mean = (1 - w) * self.mean + w * x
        self.prev = x
        return True

    def forget(self, slot: int) -> None:
        """A new request took `slot`: the last estimate's row there was another's (it counts at the mean)."""
        if self.known is not None:
            self.known[slot] = False

    def choose(self, survival_CnBL, active_C) -> int:
        """The next step's candidate index: a candidate under trial until it is timed; an untimed one; every
        explore_every steps the stalest; else the best expected rate, left for another only when the gain over
        `horizon` steps repays the measured switch cost. survival_CnBL: this step's estimate, or None (the last)."""
        active = np.asarray(active_C, bool)
        if survival_CnBL is not None:
            self.survival, self.known = survival_CnBL, active.copy()
        if self.survival is None:
            self.survival, self.known = np.zeros((len(active), len(self.candidates), 1)), np.zeros(len(active), bool)
        # before any estimate there is nothing to choose on, nor to correct against (None: the step's accept
        # lengths then do not count toward the corrections)
        told = self.mean is not None or self.known.any()
        self.chosen_tau = (
            self.expected_tokens(self.survival, active_C, self.known) / max(active.sum(), 1) if told else None
        )
        if self.trying is not None and self.timed[self.trying] < self.trial_until:
            return self.trying
        self.trying = None
        untimed = [i for i, n in enumerate(self.timed) if n == 0]
        period = (self.steps + 1) // self.explore_every if self.explore_every else 0
        if untimed or period > self.explored:
            if not untimed:
                self.explored = period
            self.trying = untimed[0] if untimed else int(np.argmin(self.timed_at))
            self.trial_until = self.timed[self.trying] + self.trial
            return self.trying
        tokens = (1.0 if self.chosen_tau is None else self.chosen_tau) * self.corrections() * active.sum()
        seconds = np.asarray(self.seconds, np.float64)
        best = budget.choose_budget_host(tokens[None], seconds)
        if self.last is None or best == self.last:
            return best
        h = self.horizon
        repaid = h * tokens[best] / (h * seconds[best] + self.switch_s) > tokens[self.last] / seconds[self.last]
        return best if repaid else self.last

    def observe(
        self,
        choice: int,
        seconds: float,
        survival_CnBL,
        accept_C,
        valid_C,
        steps: int = 1,
        realised=None,
        counterfactual=None,
    ) -> None:
        """A step of candidate `choice` took `seconds`; survival_CnBL: the estimate it reported (None for a step
        that estimated nothing); accept_C: its accept lengths, valid_C: the slots where that length is the tree's
        (active and not cut by EOS or a token limit). steps > 1: a chunk of that many steps (one executable) took
        `seconds` a step, and the survival and accept lengths are its first step's; realised = (mean accept
        length a step per slot over the chunk [C], its valid slots [C]) then speaks for all its steps.
        counterfactual = (the step's `DecodeState.realised` [C, nB], its valid slots [C]): the other candidates
        whose accept length the step's tree told (non-zero) count one step each toward their corrections. A
        chunked policy times every chunk whose seconds are given."""
        estimated = survival_CnBL is not None and self.estimate_every > 1  # its candidate's other executable
        same = choice == self.last
        if self.chunked:
            if seconds is not None:
                self.seconds[choice] = _ema(self.seconds[choice], seconds)
                self.timed[choice] += 1
                self.timed_at[choice] = self.steps
        elif same and not estimated and not self.last_estimated:  # the same executable as the step before
            first = self.timed[choice] == 0  # its first timed step may carry an executable's one-off costs
            self.seconds[choice] = _ema(None if first or self.timed[choice] == 1 else self.seconds[choice], seconds)
            self.timed[choice] += 1
            self.timed_at[choice] = self.steps
        elif same and estimated and self.timed[choice] >= 2:
            self.estimate_s = max(0.0, _ema(self.estimate_s, seconds - self.seconds[choice]))
        elif not same and not estimated and self.timed[choice] >= 2:  # a switch's extra, once for its chunk
            self.switch_s = max(0.0, _ema(self.switch_s, (seconds - self.seconds[choice]) * steps))
        self.counts[choice] += steps
        self.last, self.last_estimated = choice, estimated
        self.steps += steps
        valid = np.asarray(valid_C, bool)
        got, got_valid = (accept_C, valid) if realised is None else (realised[0], np.asarray(realised[1], bool))
        if got_valid.any() and self.chosen_tau is not None:
            self.tau_sums[choice] += steps * np.array([1, self.chosen_tau[choice], np.asarray(got)[got_valid].mean()])
        if counterfactual is not None and self.chosen_tau is not None:
            lens, cf_valid = np.asarray(counterfactual[0]), np.asarray(counterfactual[1], bool)
            for i in range(len(self.candidates)):
                told = lens[cf_valid, i]
                if i != choice and told.size and (told > 0).all():
                    self.tau_sums[i] += (1, self.chosen_tau[i], told.mean())
        if survival_CnBL is None:
            return
        counted = self._track(survival_CnBL, valid_C)
        if valid.any():
            s, y = budget.calibration_pairs(np.asarray(survival_CnBL)[valid, choice], np.asarray(accept_C)[valid])
            self.predicted.extend(s.tolist())
            self.observed.extend(y.tolist())
            del self.predicted[:-MAX_PAIRS], self.observed[:-MAX_PAIRS]
        if counted and self.refit_every and self.seen % self.refit_every == 0:
            self.gamma = budget.calibrate(self.predicted, self.observed, kind="power").gamma

    def stats(self) -> dict:
        return {
            "choices": {label(c): n for c, n in zip(self.candidates, self.counts) if n},
            "step_ms": {label(c): round(1e3 * t, 3) for c, t in zip(self.candidates, self.seconds) if t is not None},
            "switch_ms": round(1e3 * self.switch_s, 3),
            "estimate_every": self.estimate_every,
            "estimate_ms": None if self.estimate_s is None else round(1e3 * self.estimate_s, 3),
            "rho": round(self.rho, 3),
            # per candidate, over the steps it ran: the E[tau] it was chosen on against the accept length it got
            "tau_chosen_on": {label(c): round(t[1] / t[0], 3) for c, t in zip(self.candidates, self.tau_sums) if t[0]},
            "tau_realised": {label(c): round(t[2] / t[0], 3) for c, t in zip(self.candidates, self.tau_sums) if t[0]},
            "tau_correction": {label(c): round(float(k), 3) for c, k in zip(self.candidates, self.corrections())},
            "calibration_gamma": self.gamma,
        }


class AutoDecoder:
    """Two Decoders per candidate over one shared decode state (its step estimating, and `estimate_stale`):
    `prefill`, `empty` and `insert` are a Decoder's; `prepare` compiles every candidate's steps for a state's
    shapes and picks the policy of those shapes; `step` runs the current choice (`fresh`: its estimating step).
    After each step the caller reads `FIELDS` of the state to the host and passes them to `observe`, which times
    the step and picks the next candidate."""

    FIELDS = ("survival", "num_emitted", "done", "realised")
    auto = True

    def __init__(
        self, cfg, dcfg, sc: engine.StepConfig, impls, candidates=CANDIDATES, estimate_every=ESTIMATE_EVERY, **kw
    ):
        if estimate_every < 1:
            raise ValueError(f"estimate_every={estimate_every}: need >= 1")
        self.cfg, self.candidates, self.estimate_every = cfg, tuple(candidates), estimate_every
        stale = (False, True) if estimate_every > 1 else (False,)
        self.decoders = tuple(
            tuple(
                engine.Decoder(
                    cfg,
                    dcfg,
                    dataclasses.replace(sc, method=m, budget=b, estimate=self.candidates, estimate_stale=x),
                    impls,
                    **kw,
                )
                for x in stale
            )
            for m, b in self.candidates
        )
        self.sc = self.decoders[-1][0].sc
        self._prepared: dict = {}  # shapes -> (executables [candidate][estimating, stale], Policy)
        self.executables, self.policy = None, None
        self.choice, self.fresh, self._since, self._dispatched = 0, True, 0, None

    def prefill(self, *args, **kw):
        return self.decoders[0][0].prefill(*args, **kw)

    def empty(self, **kw):
        return self.decoders[0][0].empty(**kw)

    def insert(self, *args):
        return self.decoders[0][0].insert(*args)

    def prepare(self, params, dparams, state, progress=None) -> Policy:
        """Compile every candidate's step for this state's batch and cache, in parallel threads (once per shapes;
        progress(msg) is told) and use those shapes' policy, whose timings persist across calls."""
        C = state.root.shape[0]
        key = (C, state.cache.rows.shape, str(state.cache.rows.dtype))
        if key not in self._prepared:
            decs = [d for pair in self.decoders for d in pair]
            if progress:
                names = ", ".join(map(label, self.candidates))
                progress(f"compiling {len(decs)} candidate steps in parallel ({names}; estimating and not)")
            with concurrent.futures.ThreadPoolExecutor(len(decs)) as pool:
                exes = iter(pool.map(lambda d: d.compile("step", params, dparams, state), decs))
            pairs = [tuple(next(exes) for _ in pair) for pair in self.decoders]
            self._prepared[key] = (pairs, Policy(self.candidates, estimate_every=self.estimate_every))
        self.executables, self.policy = self._prepared[key]
        self.choice, self.fresh, self._since = self.policy.choose(None, np.ones(C)), True, 0
        return self.policy

    def warm(self, params, dparams, state):
        """Run every candidate's steps once on a state with `prepare`d shapes (their first-run costs), untimed;
        returns the state."""
        for exe in [e for pair in self.executables for e in pair]:
            state = exe(params, dparams, state)
        return state

    def step(self, params, dparams, state):
        if self.policy is None:
            raise RuntimeError("AutoDecoder.step: call prepare(params, dparams, state) first")
        self._dispatched = (self.choice, self.fresh, time.perf_counter())
        return self.executables[self.choice][0 if self.fresh else 1](params, dparams, state)

    def forget(self, slot: int) -> None:
        """A request was inserted into `slot` (the server): the last estimate does not speak for it."""
        if self.policy is not None:
            self.policy.forget(slot)

    def fields(self, state) -> dict:
        """What `observe` needs of the state after a step (to read to the host with the caller's own fields)."""
        return {f: getattr(state, f) for f in self.FIELDS}

    def stats(self) -> dict:
        return self.policy.stats()

    def observe(self, host: dict, was_done_C) -> int:
        """host: this step's `fields` on the host; was_done_C: the slots already done before it. Returns the next
        step's candidate index."""
        choice, fresh, started = self._dispatched
        seconds = time.perf_counter() - started
        done = np.asarray(host["done"], bool)
        valid = ~np.asarray(was_done_C, bool) & ~done
        survival = host["survival"] if fresh else None
        cf = (host["realised"], valid)
        self.policy.observe(choice, seconds, survival, np.asarray(host["num_emitted"]), valid, counterfactual=cf)
        self.choice = self.policy.choose(survival, ~done)
        self._since = 0 if fresh else self._since + 1
        self.fresh = self._since + 1 >= self.estimate_every
        return self.choice


def decode_chunk(params, dparams, state, num_steps, *, first: dict, rest: dict):
    """A candidate's estimating step, then up to num_steps - 1 of its stale steps in one while_loop (statics of
    `engine.step`: first, rest); returns the state and the chunk's start (step, tokens out), and its first step's
    accept lengths and done mask (what its estimate is calibrated against)."""
    head = {"step": state.step, "num_out": state.num_out}
    state = engine.step(params, dparams, state, **first)
    head.update(accept=state.num_emitted, done=state.done)
    return engine.decode_steps(params, dparams, state, num_steps - 1, **rest), head


class ChunkedAutoDecoder(AutoDecoder):
    """budget="auto" for generate: a dispatch runs a chunk of CHUNK_STEPS steps of one candidate (its estimating
    step, then its stale steps in a device loop), so the host's sync, policy and dispatch are paid once a chunk,
    not once a step. A trial is one chunk. A chunk cut short (its sequences ended) is timed only for a candidate
    not yet timed: its fixed costs weigh on fewer steps. Its estimate is as stale as the chunk is long. The
    server keeps AutoDecoder: it schedules between single steps."""

    def __init__(self, cfg, dcfg, sc: engine.StepConfig, impls, candidates=CANDIDATES, **kw):
        super().__init__(cfg, dcfg, sc, impls, candidates, estimate_every=2, **kw)  # (estimating, stale) pairs
        self.chunks = [
            engine.jit(
                functools.partial(decode_chunk, first=est._statics, rest=stale._statics),
                donate_argnames=("state",),
                xla_defaults=est.xla_defaults,
            )
            for est, stale in self.decoders
        ]
        self.host_s = None  # EMA of the host's seconds from a chunk's result to the next chunk's dispatch
        self._head, self._fetched, self._ran = None, None, []

    def prepare(self, params, dparams, state, progress=None) -> Policy:
        C = state.root.shape[0]
        key = (C, state.cache.rows.shape, str(state.cache.rows.dtype))
        if key not in self._prepared:
            if progress:
                names = ", ".join(map(label, self.candidates))
                progress(f"compiling {len(self.chunks)} candidate chunks in parallel ({names})")
            n = np.int32(1)
            with concurrent.futures.ThreadPoolExecutor(len(self.chunks)) as pool:
                exes = list(pool.map(lambda f: f.lower(params, dparams, state, n).compile(), self.chunks))
            policy = Policy(self.candidates, explore_every=CHUNK_EXPLORE_EVERY, chunked=True, trial=1)
            self._prepared[key] = (exes, policy)
        self.executables, self.policy = self._prepared[key]
        self.choice, self._head, self._fetched = self.policy.choose(None, np.ones(C)), None, None
        return self.policy

    def warm(self, params, dparams, state):
        for exe in self.executables:
            state, _ = exe(params, dparams, state, np.int32(1))
        return state

    def step(self, params, dparams, state):
        if self.policy is None:
            raise RuntimeError("ChunkedAutoDecoder.step: call prepare(params, dparams, state) first")
        started = time.perf_counter()  # before the dispatch: on a GPU it returns only near the chunk's end
        if self._fetched is not None:
            self.host_s = _ema(self.host_s, started - self._fetched)
        self._dispatched = (self.choice, started)
        state, self._head = self.executables[self.choice](params, dparams, state, np.int32(CHUNK_STEPS))
        return state

    def fields(self, state) -> dict:
        out = {f: getattr(state, f) for f in ("survival", "step", "done", "num_out", "realised")}
        return out if self._head is None else out | {f"head_{k}": v for k, v in self._head.items()}

    def observe(self, host: dict, was_done_C) -> int:
        """host: `fields` of the state after a chunk, on the host; was_done_C: the slots done before it."""
        choice, dispatched = self._dispatched
        self._fetched = time.perf_counter()
        ran = max(int(host["step"]) - int(host["head_step"]), 1)
        self._ran = (self._ran + [ran])[-256:]
        valid = ~np.asarray(was_done_C, bool) & ~np.asarray(host["head_done"], bool)
        # a chunk cut short carries its fixed costs on fewer steps: timed only while its candidate has no time yet
        # (so that generations shorter than a chunk still try every candidate)
        full = ran == CHUNK_STEPS or self.policy.timed[choice] == 0
        seconds = (self._fetched - dispatched) / ran if full else None
        per_step = (np.asarray(host["num_out"]) - np.asarray(host["head_num_out"])) / ran
        live = ~np.asarray(was_done_C, bool) & ~np.asarray(host["done"], bool)
        self.policy.observe(
            choice,
            seconds,
            host["survival"],
            np.asarray(host["head_accept"]),
            valid,
            steps=ran,
            realised=(per_step, live),
            counterfactual=(host["realised"], live),  # the chunk's last step's
        )
        self.choice = self.policy.choose(host["survival"], ~np.asarray(host["done"], bool))
        return self.choice

    def stats(self) -> dict:
        return super().stats() | {
            "estimate_every": "each chunk",
            "chunk_steps": round(float(np.mean(self._ran)), 1) if self._ran else None,
            "host_ms": None if self.host_s is None else round(1e3 * self.host_s, 3),
        }


@functools.lru_cache(maxsize=16)
def auto_decoder(cfg, dcfg, sc: engine.StepConfig, impls, candidates=CANDIDATES, **kw) -> ChunkedAutoDecoder:
    """generate's ChunkedAutoDecoder of these settings, shared by calls (so its compiled chunks and measured
    times persist)."""
    return ChunkedAutoDecoder(cfg, dcfg, sc, impls, candidates, **kw)
