"""The seed's experiments (streamkv_lab.experiments.synthetic / .pareto) and ``streamkv pareto``.

The five falsifiers are tests here, checked on the per-query records (not only on the
flags the experiment computes), and each falsifier is also shown to fire on a
doctored result, so none of them can pass vacuously.
"""

import json
import math
from dataclasses import replace

import pytest
import torch

from streamkv.budget import FixedWindow, Full, PerQueryMass
from streamkv_lab.cli import main
from streamkv_lab.env import threads
from streamkv_lab.experiments.pareto import _interp_log, falsifiers, run_pareto
from streamkv_lab.experiments.synthetic import GeneratorConfig, SyntheticStream, evaluate, synthesize

F64 = torch.float64
EPS = torch.finfo(F64).eps


@pytest.fixture(scope="module")
def experiment():
    return run_pareto(GeneratorConfig(), seed=0)


# ------------------------------------------------------------------- falsifiers


def test_falsifier_1_bound_never_violated(experiment):
    result, runs = experiment
    assert len(runs) >= 10 and all(r.tau is not None for r in runs)
    for r in runs:
        assert (r.err_inf <= r.tau * r.vrange).all(), r.policy
        assert (r.err_l2 <= r.tau * r.diam).all(), r.policy
    assert all(row["within_bound"] for row in result["tau_sweep"])
    assert all(row["max_error"] <= row["bound"] for row in result["tau_sweep"])


def test_falsifier_2_kept_mass_never_below_target(experiment):
    _, runs = experiment
    for r in runs:
        assert (r.kept_mass >= 1 - r.tau).all(), r.policy


def test_falsifier_3_window_never_matches_mass_with_sinks(experiment):
    result, _ = experiment
    p = result["pareto"]
    assert result["generator"]["sink_boost"] > 0
    assert len(p["ratios"]) >= 5
    assert all(r["ratio"] > 1 for r in p["ratios"]) and p["mass_better_everywhere"]
    for row in result["sink_sweep"]:
        if row["sink_boost"] > 0:
            assert row["window_mean"] > row["mass_mean"] and row["window_max"] > row["mass_max"]
        # matched: the mass budget never gets more memory than the window
        assert row["mass_cache"] <= row["window_cache"]


def test_falsifier_4_win_grows_with_sink_strength(experiment):
    rows = sorted(experiment[0]["sink_sweep"], key=lambda r: r["sink_boost"])
    assert [r["sink_boost"] for r in rows] == [0.0, 4.0, 8.0]
    ratios = [r["window_mean"] / r["mass_mean"] for r in rows]
    assert ratios[0] < ratios[1] < ratios[2]
    assert rows[0]["window_max"] < rows[1]["window_max"] < rows[2]["window_max"]


def test_falsifier_5_win_vanishes_without_sinks_and_noise(experiment):
    result, _ = experiment
    rows = sorted(result["sink_sweep"], key=lambda r: r["sink_boost"])
    assert rows[0]["mean_ratio"] < 0.5 * rows[1]["mean_ratio"]
    ctl = result["sink_control"]
    assert ctl["sink_boost"] == 0 and ctl["noise"] == 0
    assert 0.8 <= ctl["mean_ratio"] <= 1.25


def test_done_criterion_and_flags(experiment):
    result, _ = experiment
    assert result["pareto"]["ratio_median"] >= 5
    assert not any(f["falsified"] for f in result["falsifiers"])
    assert [f["name"] for f in result["falsifiers"]] == ["bound", "mass", "pareto", "mechanism", "convergence"]
    assert result["tail"]["ratio"] > 1


def _doctor(result, runs):
    return json.loads(json.dumps(result)), list(runs)


def test_each_falsifier_fires_on_a_doctored_result(experiment):
    result, runs = experiment
    names = lambda fs: {f["name"] for f in fs if f["falsified"]}  # noqa: E731

    res, rs = _doctor(result, runs)
    r0 = rs[0]
    rs[0] = replace(r0, err_inf=r0.err_inf.clone().index_fill_(0, torch.tensor([3]), r0.tau * r0.vmax * 1.01))
    assert names(falsifiers(res, rs)) == {"bound"}

    res, rs = _doctor(result, runs)
    rs[1] = replace(rs[1], kept_mass=rs[1].kept_mass.clone().index_fill_(0, torch.tensor([0]), 1 - rs[1].tau * 1.01))
    assert names(falsifiers(res, rs)) == {"mass"}

    res, rs = _doctor(result, runs)
    res["sink_sweep"][1]["window_max"] = res["sink_sweep"][1]["mass_max"]
    assert names(falsifiers(res, rs)) == {"pareto"}
    res, rs = _doctor(result, runs)
    res["pareto"]["mass_better_everywhere"] = False
    assert names(falsifiers(res, rs)) == {"pareto"}

    res, rs = _doctor(result, runs)
    res["sink_sweep"][2]["mean_ratio"] = res["sink_sweep"][1]["mean_ratio"]
    assert names(falsifiers(res, rs)) == {"mechanism"}

    res, rs = _doctor(result, runs)
    res["sink_control"]["mean_ratio"] = 1.3
    assert names(falsifiers(res, rs)) == {"convergence"}
    res, rs = _doctor(result, runs)
    res["sink_sweep"][0]["mean_ratio"] = 0.6 * res["sink_sweep"][1]["mean_ratio"]
    assert names(falsifiers(res, rs)) == {"convergence"}


# -------------------------------------------------------------- generator


def test_generator_is_deterministic_and_seeded():
    c = GeneratorConfig(frames=6, keyframes=(0,))
    a, b, other = synthesize(c, 3), synthesize(c, 3), synthesize(c, 4)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.values, b.values)
    assert not torch.equal(a.logits, other.logits)


def test_generator_structure():
    c = GeneratorConfig()
    s = synthesize(c, 0)
    t = c.tokens_per_frame
    assert s.values.dtype == F64 and s.values.shape == (c.tokens, c.value_dim)
    assert (s.values.abs() < c.value_scale).all()                       # the known range
    assert s.sinks.sum() == len(c.keyframes) * c.sink_tokens
    assert s.sinks[0] and s.sinks[16 * t + 1] and not s.sinks[16 * t + 2]
    for f in (1, 20, c.frames - 1):
        p = s.attention(f)
        assert p.shape == (t, f * t)
        assert ((p.sum(-1) - 1).abs() <= (f * t + 16) * EPS).all()
    # recency: without noise or sinks, mass per token falls with frame distance
    q = synthesize(c.with_(noise=0.0, sink_boost=0.0), 0).attention(10)[0]
    per_frame = q.reshape(10, t)[:, 2]
    assert (per_frame[1:] > per_frame[:-1]).all()


def test_sink_boost_zero_means_no_sinks():
    """Same seed: boost 0 gives exactly the logits of a stream without sink tokens."""
    c = GeneratorConfig(frames=20, keyframes=(0, 16))
    a = synthesize(c.with_(sink_boost=0.0), 1)
    b = synthesize(c.with_(sink_tokens=0), 1)
    assert torch.equal(a.logits, b.logits)
    strong = synthesize(c.with_(sink_boost=8.0), 1)
    assert (strong.logits[:, strong.sinks] >= a.logits[:, strong.sinks]).all()


# -------------------------------------------------------------- evaluator


def test_full_and_huge_window_are_exact():
    s = synthesize(GeneratorConfig(frames=10, keyframes=(0,)), 0)
    with threads(1):
        full = evaluate(s, Full())
        win = evaluate(s, FixedWindow(10_000))
    tol = 4 * s.config.tokens * EPS * float(s.values.abs().max())
    assert full.max_error <= tol and win.max_error <= tol
    assert torch.equal(full.cache, s.frame_of.new_tensor([f * 8 for f in range(1, 10) for _ in range(8)]))
    assert torch.equal(full.err_inf, win.err_inf)


def test_window_cache_size_and_tau_bookkeeping():
    s = synthesize(GeneratorConfig(frames=10, keyframes=(0,)), 0)
    with threads(1):
        w = evaluate(s, FixedWindow(20, sinks=3))
        m = evaluate(s, PerQueryMass(0.1))
    n = torch.tensor([f * 8 for f in range(1, 10) for _ in range(8)])
    assert torch.equal(w.cache, torch.clamp(n, max=20) + torch.clamp(n - 20, min=0, max=3))
    assert w.tau is None and m.tau == 0.1
    with pytest.raises(ValueError, match=r"within_bound needs a mass-budget rollout; window\(W=20, sinks=3\) has no tau"):
        w.within_bound()


def test_evaluator_rejects_bad_attention():
    s = synthesize(GeneratorConfig(frames=4, keyframes=(0,)), 0)
    bad = replace(s, logits=s.logits.clone().index_fill_(1, torch.tensor([2]), float("nan")))
    with pytest.raises(ValueError, match=r"attention of frame 1 must be finite: found nan at index \(0, 0\)"):
        evaluate(bad, PerQueryMass(0.1))

    class Unnormalised(SyntheticStream):
        def attention(self, frame):
            return super().attention(frame) * 0.5

    half = Unnormalised(**{k: getattr(s, k) for k in s.__dataclass_fields__})
    with pytest.raises(ValueError, match=r"attention of frame 1 rows must sum to 1 \(within atol=.*\): row \(0,\) sums to 0.5"):
        evaluate(half, Full())
    nan_values = replace(s, values=s.values.clone().index_fill_(0, torch.tensor([5]), float("inf")))
    with pytest.raises(ValueError, match=r"stream values must be finite: found inf at index \(5, 0\)"):
        evaluate(nan_values, FixedWindow(4))
    with pytest.raises(TypeError, match="policy must be an Oracle, got float"):
        evaluate(s, 0.1)
    with pytest.raises(TypeError, match="stream must be a SyntheticStream, got dict"):
        evaluate({}, Full())


@pytest.mark.parametrize("kw,exc,match", [
    ({"frames": 1}, ValueError, r"frames must be >= 2, got 1"),
    ({"keyframes": (0, 48)}, ValueError, r"keyframes must be frame indices in \[0, 48\), got 48"),
    ({"keyframes": [0]}, TypeError, r"keyframes must be a tuple of ints, got list"),
    ({"keyframes": (3, 3)}, ValueError, r"keyframes must be distinct"),
    ({"sink_tokens": 9}, ValueError, r"sink_tokens must be <= tokens_per_frame \(8\), got 9"),
    ({"sink_boost": -1.0}, ValueError, r"sink_boost must be finite and in \[0.0, inf\], got -1.0"),
    ({"noise": float("nan")}, ValueError, r"noise must be finite"),
    ({"value_persistence": 1.0}, ValueError, r"value_persistence must be < 1"),
    ({"value_scale": 0.0}, ValueError, r"value_scale must be finite and in \(0.0, inf\], got 0.0"),
    ({"recency_decay": "1"}, TypeError, r"recency_decay must be a real number, got str"),
])
def test_generator_config_rejects_bad_values(kw, exc, match):
    with pytest.raises(exc, match=match):
        GeneratorConfig(**kw)


def test_log_interpolation_is_exact_on_exponential_curves():
    xs = [0.0, 10.0, 30.0]
    ys = [math.exp(-0.1 * x) for x in xs]
    for x in (0.0, 5.0, 17.5, 30.0):
        assert abs(_interp_log(x, xs, ys) - math.exp(-0.1 * x)) <= 4 * EPS
    with pytest.raises(ValueError, match="outside"):
        _interp_log(31.0, xs, ys)


# --------------------------------------------------------------------- CLI

KEYS = {"tau_sweep", "pareto", "sink_sweep", "tail", "generator"}


def test_cli_writes_json_and_plots(tmp_path, capsys, experiment):
    out, png = tmp_path / "p.json", tmp_path / "plots" / "pareto.png"
    assert main(["pareto", "--json", str(out), "--plot", str(png), "--seed", "0"]) == 0
    data = json.loads(out.read_text())
    assert KEYS <= data.keys()
    assert [r["tau"] for r in data["tau_sweep"]] == [0.1, 0.05, 0.02, 0.01]
    for r in data["tau_sweep"]:
        assert {"tau", "mean_cache", "max_error", "bound", "within_bound"} <= r.keys()
        assert isinstance(r["within_bound"], bool)
    p = data["pareto"]
    assert {"window", "mass", "ratio_median", "ratio_min", "mass_better_everywhere"} <= p.keys()
    assert all(len(pt) == 2 and all(isinstance(x, float) for x in pt) for pt in p["window"] + p["mass"])
    assert [r["sink_boost"] for r in data["sink_sweep"]] == [0.0, 4.0, 8.0]
    for r in data["sink_sweep"]:
        assert {"sink_boost", "window_mean", "window_max", "mass_mean", "mass_max"} <= r.keys()
    assert {"window_max", "mass_max", "ratio"} <= data["tail"].keys()
    assert data["generator"]["seed"] == 0 and data["generator"]["sink_boost"] == GeneratorConfig().sink_boost
    assert "torch" in data["versions"]
    for path in (png, png.with_name("pareto-sinks.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "ratio median" in printed and "falsifiers" in printed
    # the JSON reproduces the library run exactly (same seed, deterministic)
    lib = experiment[0]
    assert data["pareto"]["ratio_median"] == lib["pareto"]["ratio_median"]
    assert data["tail"] == lib["tail"] and data["sink_sweep"] == lib["sink_sweep"]


def test_cli_rejects_negative_seed(capsys):
    assert main(["pareto", "--seed", "-1"]) == 2
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err
