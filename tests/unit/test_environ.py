"""``_environ.get``: ``os.environ.get`` read from its dict of encoded names (issue 32, goal 4),
so it must say what ``os.environ.get`` says after every way a process or a test changes the
environment; and the fault points and the lock wait, which read through it, must see a
variable set or removed while the process runs."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_idempotency import _environ, crashpoints
from airflow_idempotency.locks import LOCK_WAIT_ENV, lock_wait_ms

# names and values a POSIX environment can hold: no NUL, no '=' in a name
names = st.text(st.characters(blacklist_characters="\x00=", codec="utf-8"), min_size=1).map(
    lambda n: f"ADV_ENVIRON_{n}"
)
values = st.text(st.characters(blacklist_characters="\x00", codec="utf-8"))


@settings(max_examples=300, deadline=None)
@given(name=names, value=values, how=st.sampled_from(["setitem", "patch.dict", "setdefault"]))
def test_get_says_what_os_environ_says_after_each_way_of_setting_it(
    name: str, value: str, how: str
) -> None:
    assert _environ.get(name) == os.environ.get(name)
    try:
        if how == "setitem":
            os.environ[name] = value
        elif how == "setdefault":
            os.environ.setdefault(name, value)
        else:
            with mock.patch.dict(os.environ, {name: value}):
                assert _environ.get(name) == value
            assert _environ.get(name) is None
            return
        assert _environ.get(name) == value == os.environ.get(name)
    finally:
        os.environ.pop(name, None)
    assert _environ.get(name) is None


def test_an_environment_without_the_dict_is_read_as_os_environ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "environ", {"ADV_ENVIRON_PLAIN": "yes"})
    assert _environ.get("ADV_ENVIRON_PLAIN") == "yes"
    assert _environ.get("ADV_ENVIRON_OTHER") is None


def test_a_fault_point_and_the_lock_wait_see_a_variable_set_while_the_process_runs(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    crashpoints.crash_point("runner.after_lock")  # nothing set: nothing happens
    monkeypatch.setenv(crashpoints.SLEEP_ENV, "adv.environ.point=0.01")
    crashpoints.crash_point("adv.environ.point")
    assert "fault point adv.environ.point: pausing" in capfd.readouterr().err
    monkeypatch.setenv(LOCK_WAIT_ENV, "7")
    assert lock_wait_ms() == "7000"
    monkeypatch.delenv(LOCK_WAIT_ENV)
    assert lock_wait_ms() == "60000"
