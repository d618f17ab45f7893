"""The engine's MTP policy (``Engine.from_pretrained(mtp=...)``): whether and how generation drafts with the
checkpoint's multi-token-prediction head (MODEL.md section 7; docs/ARCHITECTURE.md, "MTP speculative decoding").

Whether drafting pays is a property of the machine, the model and the text, so ``"auto"`` measures it:

- **The machine.** On the first generate call that could draft, the engine times, on a scratch session, plain
  decode steps and speculative iterations with k = 1..4 drafts (k drafts, the k + 1-row verify forward, its
  wait, any rollback). ``cost[k]`` = one iteration ÷ one plain step. Cached on disk per model fingerprint,
  backend and device (``$LILY_CACHE_DIR/mtp_costs.json``, default ``~/.cache/lily``), so later engines skip it.
  If no k could pay even when nearly every draft is accepted (at acceptance ``BEST_CASE_ACCEPTANCE`` no k
  reaches ``MIN_BEST_CASE_SPEEDUP``: a device where drafting at best breaks even is not worth the rows' cost
  and the exploration), the engine stops drafting for good and stops running the MTP block's rows (their cost: about one layer's fc
  and q/k/v products per token).
- **The model and the text.** The acceptance rate (accepted drafts ÷ compared drafts) is tracked across calls.
  Each speculative iteration takes the k with the best expected speedup ``(1 + a + ... + a^k) / cost[k]`` for
  the current estimate ``a``; once the best is below 1 the call finishes with plain pipelined decoding. When
  the drafts seen so far say no k pays (a head that accepts nothing, e.g. a random synthetic one), the engine
  turns MTP off as above: either the estimate over ``MIN_TRIALS_TO_TURN_OFF`` drafts, or, sooner, an upper
  confidence bound on the acceptance (Wilson, ``CONFIDENCE_Z`` standard deviations) that still pays for no k.
  The bound makes the decision depend on the evidence rather than on how many drafts each call happened to
  compare (a call switches to plain decoding after a few rejected drafts, so a useless head yields ~2 per call).

``"on"`` always drafts (``mtp_k`` drafts per iteration) and keeps the rows; ``"off"`` never drafts and never runs
the rows. The decision, the measured costs and the acceptance are in ``engine.report()["mtp"]["policy"]``.

Thread safety: one lock (``_mu``) guards the controller's state; the measurement runs under it, so concurrent
first calls measure once. It never holds the GIL-free engine lock while waiting: it drives a scratch session
like any caller.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

MODES = ("auto", "on", "off")
MAX_K = 4
# Below this many compared drafts the acceptance estimate is too noisy to turn MTP off for good.
MIN_TRIALS_TO_TURN_OFF = 64
# Turn off sooner when even the acceptance's upper confidence bound pays for no k (after this many drafts).
CONFIDENCE_Z, MIN_TRIALS_FOR_BOUND = 2.0, 8
# The acceptance a platform must be able to pay at for "auto" to draft at all there, and by how much.
BEST_CASE_ACCEPTANCE, MIN_BEST_CASE_SPEEDUP = 0.9, 1.05
# The prior for a model not seen drafting yet (weighted as this many trials): optimistic enough to try.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 4.0
_COST_FILE = "mtp_costs.json"
# Part of the cache key: the speculative loop's cost changes with its implementation (2: the accept decision on
# the device and iterations queued behind each other), so costs measured by an older loop are measured again.
_LOOP_VERSION = 2


def check_mode(mode: object, name: str) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{name}: mtp must be one of {MODES}, got {mode!r}")
    return mode


def expected_yield(alpha: float, k: int) -> float:
    """Tokens per iteration with k drafts when each draft is accepted with probability alpha."""
    return sum(alpha**j for j in range(k + 1))


def best_k(cost: list[float], alpha: float, max_k: int = MAX_K) -> tuple[int, float]:
    """(k, expected speedup over plain decoding) for the best k in 1..max_k; k = 0 when none reaches 1."""
    best = (0, 1.0)
    for k in range(1, min(max_k, len(cost)) + 1):
        s = expected_yield(alpha, k) / cost[k - 1]
        if s > best[1]:
            best = (k, s)
    return best


def explore_k(cost: list[float], alpha: float, max_k: int = MAX_K) -> int:
    """The smallest k whose expected speedup at acceptance alpha exceeds 1 (max_k when none does)."""
    for k in range(1, min(max_k, len(cost)) + 1):
        if expected_yield(alpha, k) / cost[k - 1] > 1.0:
            return k
    return max_k


def acceptance_upper_bound(accepted: int, trials: int, z: float = CONFIDENCE_Z) -> float:
    """The Wilson score interval's upper end for `accepted` of `trials` drafts (1.0 with no trials)."""
    if trials <= 0:
        return 1.0
    p, n = accepted / trials, float(trials)
    centre = p + z * z / (2 * n)
    spread = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float(min(1.0, (centre + spread) / (1 + z * z / n)))


def physical_costs(cost: list[float]) -> list[float]:
    """A measured cost vector made physical: an iteration runs at least one forward of the main model, so it
    costs at least one plain step, and one more draft never makes it cheaper. Timing noise on a loaded machine
    can measure otherwise (a ratio of 0.9 once made "auto" draft where it cannot pay), so clamp."""
    out, floor = [], 1.0
    for c in cost:
        floor = max(floor, float(c))
        out.append(floor)
    return out


def cache_dir() -> Path:
    d = os.environ.get("LILY_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "lily"


class MtpController:
    """One engine's MTP policy: mode, measured costs, running acceptance, decision. See the module doc."""

    def __init__(self, engine, mode: str, has_head: bool):
        self._engine = engine
        self._mu = threading.Lock()
        self.mode = mode
        self.has_head = has_head
        self.cost: list[float] | None = None  # cost[k - 1]: an iteration with k drafts, in plain steps
        self.measurement: dict | None = None
        self.accepted = 0  # over every speculative call of this engine
        self.trials = 0
        self.calls = {"speculative": 0, "plain": 0}
        if not has_head:
            self.decision = "off: the checkpoint has no MTP head"
        elif mode == "off":
            self.decision = "off: mtp='off'"
        elif mode == "on":
            self.decision = "on: mtp='on' (always drafts)"
        else:
            self.decision = "auto: not measured yet (measured on the first generate call that could draft)"
        self._set_rows(has_head and mode != "off")

    def _set_rows(self, keep: bool) -> None:
        self.keeps_rows = keep
        self._engine._core.set_keep_mtp_rows(keep)

    @property
    def alpha(self) -> float:
        """The acceptance estimate: compared drafts accepted, started from the prior."""
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    def plan(self, session, mtp: str, mtp_k: int | None) -> tuple[int, dict | None]:
        """(k, policy) for one generate call: k = 0 decodes plainly; a policy dict lets the core choose k per
        iteration (auto). ``mtp`` is the call's mode (already checked)."""
        if mtp == "off":
            return 0, None
        if mtp == "on":
            return (3 if mtp_k is None else mtp_k), None
        with self._mu:
            if not self.keeps_rows or not session._core.mtp_cache_valid():
                return 0, None
            if self.cost is None:
                self._measure_locked()
                if not self.keeps_rows:
                    return 0, None
            alpha = self.alpha
            k_max = MAX_K if mtp_k is None else mtp_k
            if best_k(self.cost, alpha, k_max)[0] == 0:
                if self._evidence_says_off_locked():
                    self._turn_off_locked()
                    return 0, None
                # Too few drafts to judge the head: explore so the estimate can learn (otherwise the rows would
                # run for good with no drafting). Optimistic, as the bound is: the call starts from the best case
                # until 8 drafts are in, then from the upper bound (which pays some k, else the engine is off), so
                # the core drafts until its own running estimate says stop: a few drafts per call at least. At the
                # smallest k that pays at that acceptance: an iteration's first draft is all the estimate needs,
                # and a head that accepts nothing then costs the cheapest rejected iterations while it is judged
                # (on the full-size model k = 4 costs 3.2 plain steps a token, k = 1 1.7: benchmarks/NOTES.md).
                explore = (BEST_CASE_ACCEPTANCE if self.trials < MIN_TRIALS_FOR_BOUND
                           else acceptance_upper_bound(self.accepted, self.trials))
                return explore_k(self.cost, explore, k_max), {"cost": list(self.cost), "alpha0": explore,
                                                              "weight": PRIOR_WEIGHT}
            return k_max, {"cost": list(self.cost), "alpha0": alpha, "weight": min(float(self.trials), 32.0)
                           + PRIOR_WEIGHT}

    def _evidence_says_off_locked(self) -> bool:
        """Whether the drafts compared so far show that no k pays: the estimate over enough drafts, or the
        acceptance's upper confidence bound over fewer."""
        if self.trials >= MIN_TRIALS_TO_TURN_OFF and best_k(self.cost, self.alpha)[0] == 0:
            return True
        return (self.trials >= MIN_TRIALS_FOR_BOUND
                and best_k(self.cost, acceptance_upper_bound(self.accepted, self.trials))[0] == 0)

    def _turn_off_locked(self) -> None:
        bound = acceptance_upper_bound(self.accepted, self.trials)
        self.decision = (f"off: acceptance {self.alpha:.3f} over {self.trials} drafts (upper bound {bound:.3f}) "
                         f"pays for no k (best expected speedup {best_k(self.cost, self.alpha, MAX_K)[1]:.2f})")
        self._set_rows(False)

    def observe(self, stats: dict, speculative: bool) -> None:
        """After a generate call of mode auto: fold its acceptance in; turn MTP off when no k pays."""
        with self._mu:
            self.calls["speculative" if speculative else "plain"] += 1
            if not speculative:
                return
            self.accepted += stats["accepted"]
            self.trials += stats["trials"]
            if self.mode == "auto" and self.cost is not None and self.keeps_rows:
                k, s = best_k(self.cost, self.alpha)
                if self._evidence_says_off_locked():
                    self._turn_off_locked()
                elif k > 0 and self.trials >= MIN_TRIALS_TO_TURN_OFF:
                    self.decision = (f"auto: drafting, best k {k} (expected speedup {s:.2f} at acceptance "
                                     f"{self.alpha:.3f})")

    # ---- the machine's cost of an iteration ----

    def _key(self) -> str:
        e = self._engine
        core = e._core.report()
        return f"{e.fingerprint}|{core['backend']}|{core['device']}|loop{_LOOP_VERSION}"

    def _measure_locked(self) -> None:
        key = self._key()
        path = cache_dir() / _COST_FILE
        cached = _read_costs(path).get(key)
        if cached is not None:
            self.cost = physical_costs([float(c) for c in cached["cost"]])
            self.measurement = dict(cached, cached=True, file=str(path))
        else:
            t0 = time.perf_counter()
            m = measure_costs(self._engine)
            m["seconds"] = round(time.perf_counter() - t0, 3)
            self.cost = m["cost"] = physical_costs(m["cost"])
            self.measurement = dict(m, cached=False, file=str(path))
            _write_costs(path, key, m)
        best = best_k(self.cost, BEST_CASE_ACCEPTANCE)
        costs = ", ".join(f"k={k}: {c:.2f}" for k, c in enumerate(self.cost, 1))
        if best[0] == 0 or best[1] < MIN_BEST_CASE_SPEEDUP:
            self.decision = (f"off: on this device an iteration costs {costs} plain steps; even at acceptance "
                             f"{BEST_CASE_ACCEPTANCE} no k gains {MIN_BEST_CASE_SPEEDUP - 1:.0%} (best "
                             f"{best[1]:.2f}x)")
            self._set_rows(False)
        else:
            self.decision = (f"auto: drafting while it pays (iteration cost {costs} plain steps; at acceptance "
                             f"{BEST_CASE_ACCEPTANCE} k={best[0]} would give {best[1]:.2f}x)")

    def report(self) -> dict:
        with self._mu:
            out = {"mode": self.mode, "decision": self.decision, "keeps_rows": self.keeps_rows,
                   "acceptance": round(self.alpha, 4) if self.trials else None, "compared_drafts": self.trials,
                   "accepted_drafts": self.accepted, "calls": dict(self.calls)}
            if self.cost is not None:
                out["iteration_cost"] = {k: round(c, 3) for k, c in enumerate(self.cost, 1)}
                out["measurement"] = self.measurement
            return out


def measure_costs(engine, *, prompt: int = 48, short: int = 8, long: int = 40, repeats: int = 3) -> dict:
    """Times plain decode steps and speculative iterations with k = 1..MAX_K drafts on a scratch session of
    `engine` (greedy, a fixed pseudo-random prompt). Differences of a short and a long run cancel the fixed
    cost of a call (the prompt's sampler start, the first step). Returns {"cost": [c1..c4], "plain_ms",
    "iteration_ms", "context"}: medians over `repeats`."""
    from .sampling import SamplingParams

    params = SamplingParams(temperature=0.0).to_core()
    ids = np.random.default_rng(0).integers(0, engine.config.vocab_size, prompt).tolist()
    s = engine.session(max_context=prompt + long + MAX_K + 2)
    try:
        s.prefill(ids)
        snap = s.snapshot()

        def run(n: int, k: int) -> tuple[float, int]:
            s.restore(snap)
            t0 = time.perf_counter()
            # Tokens as Session.generate takes them: an iteration's in one callback.
            s._core.generate(n, params, [], lambda t, logits=None: 1, False, k, None,
                             lambda toks, logits=None: (len(toks), True))
            dt = time.perf_counter() - t0
            return dt, (s._core.last_mtp_stats()["steps"] if k else n)

        run(short, 0)  # warm-up: graphs, kernels, scratch buffers
        for k in range(1, MAX_K + 1):
            run(short, k)
        plain, per_iter = [], {k: [] for k in range(1, MAX_K + 1)}
        for _ in range(repeats):
            (a, na), (b, nb) = run(short, 0), run(long, 0)
            plain.append((b - a) / (nb - na))
            for k in per_iter:
                (a, na), (b, nb) = run(short, k), run(long, k)
                per_iter[k].append((b - a) / max(nb - na, 1))
        plain_s = float(np.median(plain))
        iters = {k: float(np.median(v)) for k, v in per_iter.items()}
        return {"cost": [max(iters[k] / plain_s, 1e-3) for k in range(1, MAX_K + 1)],
                "plain_ms": round(plain_s * 1e3, 4),
                "iteration_ms": {k: round(v * 1e3, 4) for k, v in iters.items()}, "context": prompt}
    finally:
        s.close()


def _read_costs(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_costs(path: Path, key: str, m: dict) -> None:
    """Best effort (a read-only home must not break generation); atomic replace so readers see whole files."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_costs(path)
        data[key] = {"cost": m["cost"], "plain_ms": m["plain_ms"], "iteration_ms": m["iteration_ms"],
                     "context": m["context"], "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
