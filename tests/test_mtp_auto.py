"""The engine's MTP policy (issue 14 item 7, src/lily/mtp.py) on the CPU backend.

- mtp="off" runs none of the MTP block's rows (fewer ops per decode step, the same logits bit for bit as an engine
  that keeps them), the session's block cache is then not valid, and drafting there is refused with a clear error
  while the session stays usable. A snapshot, a session file, a reset carry or restore the validity.
- The core's adaptive loop (MtpPolicy): k chosen per forward from the cost table and the acceptance; drafting
  that cannot pay switches the call to plain pipelined decoding, the output and the state still the plain ones.
- mtp="auto": the first call measures the iteration costs on a scratch session, caches them on disk per
  model/backend/device, and a later engine reads them back; a head that accepts nothing (the random synthetic
  one) ends with MTP off and the block's rows no longer run; the output is the plain greedy output throughout.

Breaks tried, each made the named tests fail: running the block's rows whatever the engine's flag
(test_off_runs_no_block_rows); the switch to plain decoding without marking its first token as fed (its
state test); MtpPolicy::choose ignoring cost (test_policy_chooses_k_from_the_cost_table).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import lily
from lily import mtp as mtp_policy
from lily.synthetic import TINY_CONFIG, write_synthetic_checkpoint

PROMPT = [1, 5, 9, 22, 7, 100, 3, 44, 12]
GREEDY = lily.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_synthetic_checkpoint(tmp_path_factory.mktemp("mtp-auto") / "m", TINY_CONFIG, fmt="hf",
                                          mtp_layers=1, seed=11))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "cache"))


def engine(path, mode):
    return lily.Engine.from_pretrained(path, backend="cpu", prefill_chunk=8, mtp=mode)


def greedy(s, n, **kw):
    return list(s.generate(n, GREEDY, stop_token_ids=[], **kw))


def test_off_runs_no_block_rows(path):
    with engine(path, "on") as on, engine(path, "off") as off:
        a, b = on.session(max_context=64), off.session(max_context=64)
        la, lb = a.prefill(PROMPT, all_logits=True), b.prefill(PROMPT, all_logits=True)
        assert np.array_equal(la, lb)
        assert greedy(a, 6, mtp="off") == greedy(b, 6)
        ops_on = a.stats()["decode_step"]["ops"]
        ops_off = b.stats()["decode_step"]["ops"]
        assert ops_off < ops_on  # the block's fc, norms, q/k/v, prep and kv_append are gone
        assert a.mtp_cache_valid and not b.mtp_cache_valid
        assert on.report()["mtp"]["policy"]["keeps_rows"] and not off.report()["mtp"]["policy"]["keeps_rows"]


def test_drafting_without_the_cache_is_refused_and_the_session_goes_on(path):
    with engine(path, "off") as e:
        s = e.session(max_context=64)
        s.prefill(PROMPT)
        with pytest.raises(ValueError, match="mtp='on' needs the MTP block's cache"):
            s.generate(4, mtp="on")
        with pytest.raises(ValueError, match="does not keep the MTP block's cache"):  # the core's own check
            s._core.generate(4, GREEDY.to_core(), [], lambda t: 1, False, 2)
        assert s.tokens == PROMPT
        assert len(greedy(s, 4)) == 4
        with pytest.raises(ValueError, match="mtp must be one of"):
            lily.Engine.from_pretrained(path, backend="cpu", mtp="sometimes")


def test_validity_follows_snapshots_files_and_reset(path, tmp_path):
    with engine(path, "on") as e:
        s = e.session(max_context=64)
        s.prefill(PROMPT)
        good = s.snapshot()
        e._core.set_keep_mtp_rows(False)  # what "auto" does once it decides against drafting
        s.prefill([3, 4])
        assert not s.mtp_cache_valid
        bad = s.snapshot()
        s.save(tmp_path / "bad.safetensors")
        e._core.set_keep_mtp_rows(True)
        s.prefill([8])  # keeping again does not make the missing rows appear
        assert not s.mtp_cache_valid
        r = e.session(max_context=64)
        r.restore(bad)
        assert not r.mtp_cache_valid
        r.restore(good)
        assert r.mtp_cache_valid
        r2 = e.session(max_context=64)
        r2.restore(good)
        assert greedy(r, 5, mtp="on", mtp_k=2) == greedy(r2, 5, mtp="off")
        loaded = e.load_session(tmp_path / "bad.safetensors")
        assert not loaded.mtp_cache_valid
        s.reset()
        assert s.mtp_cache_valid


def test_policy_chooses_k_from_the_cost_table(path):
    """Injected drafts equal to the greedy continuation (all accepted): the core's choice of k follows the costs."""
    with engine(path, "on") as e:
        base = greedy(_prefilled(e), 24, mtp="off")
        for cost, k in [([1.05, 5, 5, 5], 1), ([1.2, 1.3, 1.4, 1.5], 4), ([1.5, 1.6, 9, 9], 2)]:
            s = _prefilled(e)
            s._core._draft_override(len(PROMPT), base)
            out = _core_generate(s, 24, 4, {"cost": cost, "alpha0": 0.9, "weight": 1000.0})
            assert out == base
            st = s.mtp_stats()
            assert st["mean_k"] > k - 0.5 and st["plain_tokens"] == 0, (cost, st)
            # the expected pick for a = 0.9 over the table
            assert mtp_policy.best_k(cost, 0.9)[0] == k


def test_policy_switches_to_plain_decoding_when_drafting_cannot_pay(path):
    with engine(path, "on") as e:
        plain = _prefilled(e)
        base = greedy(plain, 20, mtp="off")
        # Never pays: the whole call is plain, pipelined.
        s = _prefilled(e)
        assert _core_generate(s, 20, 4, {"cost": [9, 9, 9, 9], "alpha0": 0.5, "weight": 4.0}) == base
        assert s.mtp_stats()["steps"] == 0 and s.mtp_stats()["plain_tokens"] == 19
        assert s.tokens == plain.tokens
        assert np.array_equal(s.logits, plain.logits)
        # A stop token in the plain part: fed eagerly there, as generate() does; the context is the plain one's.
        stop = base[10]
        cut = base[: base.index(stop) + 1]
        p2, s2 = _prefilled(e), _prefilled(e)
        assert list(p2.generate(20, GREEDY, stop_token_ids=[stop], mtp="off")) == cut
        out = []
        s2._core.generate(20, GREEDY.to_core(), [stop], lambda t, logits=None: out.append(t) or 1, False, 4,
                          {"cost": [9, 9, 9, 9], "alpha0": 0.5, "weight": 4.0})
        assert out == cut and s2.tokens == p2.tokens and s2.position == p2.position
        # Pays at first (alpha0 0.9), but the random head accepts nothing: after a few forwards it switches.
        s = _prefilled(e)
        assert _core_generate(s, 20, 4, {"cost": [1.3, 1.5, 1.8, 2.1], "alpha0": 0.9, "weight": 2.0}) == base
        st = s.mtp_stats()
        assert 0 < st["steps"] < 19 and st["plain_tokens"] > 0 and st["accepted"] < st["trials"]
        assert s.tokens == plain.tokens
        np.testing.assert_allclose(s.logits, plain.logits, rtol=1e-5, atol=1e-5)
        assert greedy(s, 6, mtp="off") == greedy(plain, 6, mtp="off")  # and it goes on like the plain one


def test_auto_measures_caches_and_turns_a_useless_head_off(path, tmp_path):
    with engine(path, "auto") as e:
        rep = e.report()["mtp"]["policy"]
        assert rep["mode"] == "auto" and rep["keeps_rows"] and "not measured" in rep["decision"]
        ref = engine(path, "off")
        outs = []
        for i in range(12):
            s = e.session(max_context=96)
            s.prefill(PROMPT + [i])
            outs.append(greedy(s, 24))
            r = ref.session(max_context=96)
            r.prefill(PROMPT + [i])
            assert outs[-1] == greedy(r, 24)  # exact whatever it decided
        rep = e.report()["mtp"]["policy"]
        assert set(rep["iteration_cost"]) == {1, 2, 3, 4} and rep["measurement"]["cached"] is False
        assert rep["decision"].startswith("off") and not rep["keeps_rows"], rep
        s = e.session(max_context=64)
        s.prefill(PROMPT)
        assert not s.mtp_cache_valid  # rows no longer run
        ref.close()
        cache = json.loads((tmp_path / "cache" / "mtp_costs.json").read_text())
        assert len(cache) == 1 and len(next(iter(cache.values()))["cost"]) == 4
    with engine(path, "auto") as again:  # the costs come from the file
        s = again.session(max_context=64)
        s.prefill(PROMPT)
        greedy(s, 4)
        m = again.report()["mtp"]["policy"]["measurement"]
        assert m["cached"] is True


def test_auto_learns_that_a_head_accepts_nothing(path):
    """On a device where drafting could pay (a cheap cost table planted instead of the measurement), the random
    head's acceptance over enough drafts pays for no k: the engine turns MTP off and stops running the rows."""
    with engine(path, "auto") as e:
        ctl = e._mtp
        ctl.cost, ctl.measurement = [1.1, 1.2, 1.3, 1.4], {"planted": True}
        drafted = 0
        while ctl.keeps_rows:
            s = e.session(max_context=96)
            s.prefill(PROMPT + [drafted % 50])
            out = greedy(s, 20)
            r = e.session(max_context=96)
            r.prefill(PROMPT + [drafted % 50])
            assert out == greedy(r, 20, mtp="off")
            drafted += max(s.mtp_stats()["drafted"], 1)
            assert drafted < 2000, ctl.report()
        rep = e.report()["mtp"]["policy"]
        n, acc = rep["compared_drafts"], rep["accepted_drafts"]
        assert rep["decision"].startswith("off: acceptance") and n >= mtp_policy.MIN_TRIALS_FOR_BOUND
        # It turned off on evidence: the acceptance's upper bound over those drafts pays for no k ...
        assert mtp_policy.best_k(ctl.cost, mtp_policy.acceptance_upper_bound(acc, n))[0] == 0
        assert rep["calls"]["speculative"] >= 1
        # ... and not much later than that evidence existed (the last call adds at most a few drafts).
        assert n < 64, rep


def test_expected_yield_and_best_k():
    assert mtp_policy.expected_yield(0.0, 3) == 1.0
    assert mtp_policy.expected_yield(0.5, 2) == pytest.approx(1.75)
    assert mtp_policy.best_k([2, 2, 2, 2], 0.3) == (0, 1.0)
    k, s = mtp_policy.best_k([1.1, 1.2, 1.3, 1.4], 0.8)
    assert k == 4 and s == pytest.approx(mtp_policy.expected_yield(0.8, 4) / 1.4)


def test_acceptance_upper_bound():
    ub = mtp_policy.acceptance_upper_bound
    assert ub(0, 0) == 1.0
    assert 0.13 < ub(0, 24) < 0.15  # Wilson, z = 2: 4 / 28
    assert ub(0, 200) < ub(0, 24) < ub(0, 8)  # more evidence, a tighter bound
    assert ub(30, 100) > 0.3 and ub(90, 100) <= 1.0 and ub(100, 100) == pytest.approx(1.0)
    # A head accepting nothing on a machine where k = 1 costs 1.38 steps: off after ~2 dozen drafts, not 64.
    assert mtp_policy.best_k([1.38, 1.69, 2.0, 2.48], ub(0, 24))[0] == 0
    assert mtp_policy.best_k([1.38, 1.69, 2.0, 2.48], ub(0, 4))[0] > 0  # too little evidence yet


def test_measured_costs_are_made_physical():
    # Noise on a loaded machine once measured an iteration cheaper than a plain step (0.93 at k = 3).
    assert mtp_policy.physical_costs([1.2, 1.1, 0.93, 1.5]) == [1.2, 1.2, 1.2, 1.5]
    assert mtp_policy.physical_costs([0.5, 0.7, 0.9, 1.3]) == [1.0, 1.0, 1.0, 1.3]


def test_cached_costs_below_one_are_clamped(path, tmp_path):
    with engine(path, "auto") as e:
        key = e._mtp._key()
        (tmp_path / "cache").mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / "mtp_costs.json").write_text(json.dumps(
            {key: {"cost": [0.8, 0.9, 0.95, 0.99], "plain_ms": 1.0, "iteration_ms": {}, "context": 48}}))
        s = e.session(max_context=64)
        s.prefill(PROMPT)
        greedy(s, 4)
        rep = e.report()["mtp"]["policy"]
        assert rep["measurement"]["cached"] is True
        assert all(c >= 1.0 for c in rep["iteration_cost"].values()), rep


def _prefilled(e):
    s = e.session(max_context=96)
    s.prefill(PROMPT)
    return s


def _core_generate(s, n, k, policy):
    out = []
    s._core.generate(n, GREEDY.to_core(), [], lambda t, logits=None: out.append(t) or 1, False, k, policy)
    return out


def test_a_device_where_drafting_at_best_breaks_even_is_off_at_once(path):
    """The CI machine's table (k = 2 gives 1.00x at acceptance 0.9): off at the measurement, the rows stop."""
    with engine(path, "auto") as e:
        ctl = e._mtp
        with ctl._mu:
            ctl.cost = None
        key = ctl._key()
        (mtp_policy.cache_dir()).mkdir(parents=True, exist_ok=True)
        (mtp_policy.cache_dir() / "mtp_costs.json").write_text(json.dumps(
            {key: {"cost": [2.27, 2.70, 3.74, 4.15], "plain_ms": 1.0, "iteration_ms": {}, "context": 48}}))
        s = e.session(max_context=64)
        s.prefill(PROMPT)
        greedy(s, 4)
        rep = e.report()["mtp"]["policy"]
        assert rep["decision"].startswith("off: on this device") and not rep["keeps_rows"], rep


@pytest.mark.parametrize("cost, k", [([1.6, 1.9, 2.2, 2.5], 1), ([2.0, 2.1, 2.2, 2.5], 2)])
def test_exploration_drafts_when_the_prior_pays_for_no_k(path, cost, k):
    """Costs where the prior (0.5) pays for no k but the best case does: calls still draft (optimistically), so
    the drafts accumulate and a head that accepts nothing is turned off, instead of rows kept with no drafting.
    They draft at the smallest k that pays at the optimistic acceptance (one draft per forward where k = 1 could
    pay; 2 where only deeper drafting could), not at the deepest, so the useless head costs the cheapest rejected
    iterations until it is off."""
    assert mtp_policy.explore_k(cost, mtp_policy.BEST_CASE_ACCEPTANCE) == k
    with engine(path, "auto") as e:
        ctl = e._mtp
        ctl.cost, ctl.measurement = list(cost), {"planted": True}
        assert mtp_policy.best_k(ctl.cost, mtp_policy.PRIOR_ACCEPTANCE)[0] == 0
        assert mtp_policy.best_k(ctl.cost, mtp_policy.BEST_CASE_ACCEPTANCE)[1] >= mtp_policy.MIN_BEST_CASE_SPEEDUP
        drafting_calls = 0
        for i in range(40):
            if not ctl.keeps_rows:
                break
            s = e.session(max_context=96)
            s.prefill(PROMPT + [i])
            greedy(s, 16)
            st = s.mtp_stats()
            if st["steps"]:
                drafting_calls += 1
                assert 1 <= st["mean_k"] <= k, st
        rep = e.report()["mtp"]["policy"]
        assert drafting_calls > 0 and rep["compared_drafts"] > 0 and rep["decision"].startswith("off: acceptance"), rep
