"""run_io.py: the run's pictures and its TensorBoard scalars are the metrics it logged."""

import json

import pytest

from bookkeeping import run_io
from config import Config, ConfigError, resolve
from conftest import needs


def rows(n=12):
    return [
        {
            "step": k,
            "reward": 0.1 * (k % 5),
            "kl": 0.01 * k,
            "clip_low": 0.0,
            "clip_high": 0.02,
            "entropy": 0.5,
            "rho_prime_max": 1.0 + 0.1 * k,
            "rho_prime_mean": 1.0,
            **({"eval_accuracy": 0.4} if k == 5 else {}),
        }
        for k in range(n)
    ]


def test_curves_png_has_one_panel_per_quantity(tmp_path):
    needs("matplotlib", "plot")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    seen = []
    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig
    spy = lambda fig, *a, **kw: seen.append([ax.get_title() for ax in fig.axes]) or real(fig, *a, **kw)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", spy)
        path = run_io.write_curves(tmp_path, {"eval_accuracy_start": 0.3, "eval_accuracy_end": 0.5, "steps": 12})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen == [[title for title, _, _ in run_io.PANELS]]


def test_tensorboard_logs_every_numeric_metric(tmp_path):
    needs("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = run_io.RunWriter(resolve(Config(out=str(tmp_path), report_to="tensorboard")))
    for r in rows(3):
        writer.metrics(r)
    writer._tb.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(f"grpo/{k}" for k in rows(3)[0] if k != "step")
    assert [e.value for e in events.Scalars("grpo/kl")] == pytest.approx([0.0, 0.01, 0.02])
    assert [e.step for e in events.Scalars("grpo/kl")] == [0, 1, 2]


def test_report_to_tensorboard_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **kw):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match="--report-to tensorboard"):
        run_io.RunWriter(resolve(Config(out=str(tmp_path), report_to="tensorboard")))
