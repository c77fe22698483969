"""A malformed ops switch in the environment is one `error:` line and exit code 2 before the entry point runs.
The tests take force_ref before monkeypatch: its teardown re-reads the environment after monkeypatch restored it."""

from __future__ import annotations

import pytest

from surogate_jax import cli


@pytest.mark.parametrize("var, value", [("SUROGATE_JAX_OPS", "reff"), ("SUROGATE_JAX_FFI_GRAPHS", "maybe")])
def test_malformed_op_switch_is_one_error_line(force_ref, monkeypatch, capsys, var, value):
    monkeypatch.setenv(var, value)
    ran = []
    with pytest.raises(SystemExit) as exc:
        cli.run(lambda argv: ran.append(argv), [])
    assert exc.value.code == 2 and not ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and var in err[0], err


def test_good_switch_runs_the_entry_point(force_ref, monkeypatch):
    monkeypatch.setenv("SUROGATE_JAX_OPS", "ref:rope")
    with pytest.raises(SystemExit) as exc:
        cli.run(lambda argv: 0, [])
    assert exc.value.code == 0
