"""Fuzzed input (hypothesis): whatever comes in is either accepted and kept exactly, or
refused with the provider's InvalidInputError before anything is written.

Covered: run keys (resolve_run_key with arbitrary text, dates, offsets, time zones and run
types), the operator's conf handling (conf_flag, resolve_run_key and run_options with
arbitrary JSON values in conf and params), job names and run keys through
run_idempotently against real Postgres, and idempotency keys and request payloads through
OutboundLedger.send_all against the real accounting service process.

Every example starts from empty tables, so "nothing written" is checked, not assumed.
The tests at the end pin the bugs this fuzzing found (fixed in 70ef64c): each was a
strict xfail until the fix.

The advisory mode only: what is fuzzed is input (its validation happens before any lock is
taken, in both modes), and hypothesis refuses the function-scoped ``lock_mode`` fixture; the
lease mode's decision writes the same records from the same checked values.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pendulum
import psycopg
import pytest
from airflow.providers.common.compat.sdk import DAG
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_idempotency import Effect, OutboundLedger, Retries, post_json
from airflow_idempotency.compat import AIRFLOW_V_3_0_PLUS, AirflowFailException, Context
from airflow_idempotency.exceptions import (
    IdempotencyKeyConflictError,
    InvalidInputError,
    InvalidRunKeyError,
)
from airflow_idempotency.operator import IdempotentRunOperator, conf_flag
from airflow_idempotency.run_key import (
    MAX_KEY_LENGTH,
    RunFacts,
    RunKeyRule,
    check_text,
    key_parts,
    resolve_run_key,
)
from airflow_idempotency.runner import RunContext, RunOutcome
from airflow_idempotency.schema import ensure_schema
from devtools.postgres import temporary_database
from support.effects import run_once
from support.faults import figures, refusal
from support.locks import advisory_locks

FUZZ = settings(
    max_examples=80,  # each test sets its own count
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies ---------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
# Any code point, surrogates, controls and unassigned ones included.
ANY_CHAR = st.characters(exclude_categories=())
# Printable text with no blank at either end: what a well-behaved name looks like.
PRINTABLE = st.text(st.characters(categories=["L", "M", "N", "P", "S"]), min_size=1, max_size=40)
ANY_TEXT = st.one_of(
    PRINTABLE,
    st.builds("{} {}".format, PRINTABLE, PRINTABLE),  # inner blanks are fine
    st.text(ANY_CHAR, max_size=30),
    st.text(max_size=30).map(lambda t: f" {t}"),  # leading blank
    st.text(ANY_CHAR, min_size=MAX_KEY_LENGTH - 2, max_size=MAX_KEY_LENGTH + 2),  # the limit
    st.text(st.characters(min_codepoint=0x10000), min_size=150, max_size=MAX_KEY_LENGTH),
)
YEAR = st.integers(1000, 3000)


def _fmt(template: str) -> st.SearchStrategy[str]:
    """Key-shaped text with realistic years and any (possibly impossible) month/day/hour."""
    return st.builds(
        template.format,
        year=YEAR,
        month=st.integers(0, 99),
        day=st.integers(0, 99),
        hour=st.integers(0, 99),
    )


# Well-formed keys of periods that ended before any NOW below.
ENDED_KEY = st.one_of(
    st.dates(dt.date(1000, 1, 1), dt.date(1999, 12, 31)).map(dt.date.isoformat),
    st.dates(dt.date(1000, 1, 1), dt.date(1999, 12, 31)).map(lambda d: f"{d:%Y-%m}"),
    st.dates(dt.date(1000, 1, 1), dt.date(1999, 12, 31)).map(lambda d: f"{d:%Y-%m-%d}T07Z"),
)
RUN_KEY_INPUT = st.one_of(
    ENDED_KEY,
    _fmt("{year:04d}-{month:02d}-{day:02d}"),
    _fmt("{year:04d}-{month:02d}-{day:02d}T{hour:02d}Z"),
    _fmt("{year:04d}-W{month:02d}"),
    _fmt("{year:04d}-{month:02d}"),
    st.text(max_size=20),
    JSON,
    st.dates(dt.date(1000, 1, 1), dt.date(3000, 1, 1)),
)
ZONES = st.sampled_from(
    ["UTC", "Europe/Amsterdam", "America/New_York", "Asia/Kolkata", "Pacific/Kiritimati"]
)
TIMETABLES = st.sampled_from(
    [None, "CronTriggerTimetable", "CronDataIntervalTimetable", "DeltaDataIntervalTimetable"]
)
RUN_TYPES = st.sampled_from(
    ["manual", "scheduled", "backfill", "asset_triggered", "operator_triggered"]
) | st.text(max_size=8)
LOGICAL_DATES = st.none() | st.datetimes(
    min_value=dt.datetime(1900, 1, 1),
    max_value=dt.datetime(2200, 1, 1),
    timezones=st.sampled_from(
        [dt.timezone.utc, dt.timezone(dt.timedelta(hours=-11)), dt.timezone(dt.timedelta(hours=14))]
    ),
)
NOW = st.datetimes(
    min_value=dt.datetime(2000, 1, 1),
    max_value=dt.datetime(2100, 1, 1),
    timezones=st.just(dt.timezone.utc),
)


def tallied(name: str, tally: Counter[str]) -> None:
    """Print how the examples split (for FAULTS.md) and check both outcomes were reached."""
    figures(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    assert tally["accepted"] > 0 and tally["refused"] > 0, tally


# -- run keys -----------------------------------------------------------------------------


def test_resolve_run_key_accepts_a_valid_ended_period_or_refuses_cleanly() -> None:
    """Arbitrary explicit keys, logical dates, offsets, zones and run types (years 1000-3000) give a well-formed key of an ended period, or an InvalidRunKeyError."""
    tally: Counter[str] = Counter()

    @settings(FUZZ, max_examples=300)
    @given(
        period=st.sampled_from(["hour", "day", "week", "month"]),
        offset=st.none() | st.integers(-400, 400),
        allow_open=st.booleans(),
        timezone=ZONES,
        timetable=TIMETABLES,
        run_type=RUN_TYPES,
        logical_date=LOGICAL_DATES,
        conf_key=st.none() | RUN_KEY_INPUT,
        params_key=st.none() | RUN_KEY_INPUT,
        now=NOW,
    )
    @example(  # the key a scheduled run of finalize_invoices derives
        period="day",
        offset=None,
        allow_open=False,
        timezone="UTC",
        timetable="CronTriggerTimetable",
        run_type="scheduled",
        logical_date=dt.datetime(2026, 10, 2, 1, tzinfo=dt.timezone.utc),
        conf_key=None,
        params_key=None,
        now=dt.datetime(2026, 10, 2, 1, 0, 5, tzinfo=dt.timezone.utc),
    )
    @example(  # a manual rerun naming its date in the conf
        period="day",
        offset=None,
        allow_open=False,
        timezone="Europe/Amsterdam",
        timetable="CronTriggerTimetable",
        run_type="manual",
        logical_date=None,
        conf_key="2026-10-01",
        params_key=None,
        now=dt.datetime(2026, 10, 5, tzinfo=dt.timezone.utc),
    )
    def check(
        period: Any,
        offset: int | None,
        allow_open: bool,
        timezone: str,
        timetable: str | None,
        run_type: str,
        logical_date: dt.datetime | None,
        conf_key: Any,
        params_key: Any,
        now: dt.datetime,
    ) -> None:
        rule = RunKeyRule(period=period, offset=offset, allow_open_period=allow_open)
        try:
            resolved = resolve_run_key(
                rule,
                RunFacts(
                    timezone=timezone,
                    timetable_name=timetable,
                    run_type=run_type,
                    logical_date=logical_date,
                    conf_run_key=conf_key,
                    params_run_key=params_key,
                    now=now,
                ),
            )
        except InvalidRunKeyError:
            tally["refused"] += 1
            return
        tally["accepted"] += 1
        key = resolved.run_key
        assert check_text(key, "run key") == key
        period_key = key_parts(key).period  # a segmented key (eu|2026-10-01) has one period
        assert period_key is not None
        _, end = rule.period_bounds(period_key, timezone)  # well-formed: parses back
        assert allow_open or end <= now
        explicit = conf_key if conf_key not in (None, "") else params_key
        if explicit not in (None, ""):
            tally["accepted explicit"] += 1
            assert run_type in ("manual", "operator_triggered")
            assert key == (str(explicit) if isinstance(explicit, dt.date) else explicit)
            assert resolved.source == ("conf" if conf_key not in (None, "") else "params")
        else:
            assert logical_date is not None
            assert key == rule.key_for(logical_date, timezone, rule.effective_offset(timetable))
            assert resolved.source == "logical_date"

    check()
    tallied("run keys", tally)


# -- the operator's conf handling ----------------------------------------------------------

FLAG_INPUT = st.one_of(
    JSON, st.sampled_from(["true", "false", "TRUE", "False", "yes", "1", "", " true"])
)


def test_conf_flag_is_a_boolean_or_refused() -> None:
    """A flag from arbitrary JSON in conf and params is true/false exactly when it is a boolean, null or the text true/false, and InvalidInputError otherwise."""
    tally: Counter[str] = Counter()

    @settings(FUZZ, max_examples=200)
    @given(
        conf=st.dictionaries(st.sampled_from(["force", "dry_run", "other"]), FLAG_INPUT),
        params=st.none() | st.dictionaries(st.sampled_from(["force", "dry_run"]), FLAG_INPUT),
    )
    def check(conf: dict[str, Any], params: Any) -> None:
        context: Any = {"dag_run": SimpleNamespace(conf=conf), "params": params}
        raw = conf.get("force", (params or {}).get("force", False))
        if raw is None or isinstance(raw, bool):
            expected: bool | None = bool(raw)
        elif isinstance(raw, str) and raw.lower() in ("true", "false"):
            expected = raw.lower() == "true"
        else:
            expected = None
        if expected is None:
            tally["refused"] += 1
            with pytest.raises(InvalidInputError, match="force must be true or false"):
                conf_flag(context, "force")
        else:
            tally["accepted"] += 1
            assert conf_flag(context, "force") is expected

    check()
    tallied("conf flags", tally)


with DAG(
    dag_id="fuzz_conf",
    schedule="0 1 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
):
    FUZZ_OPERATOR = IdempotentRunOperator(task_id="work", python_callable=lambda run: None)


@pytest.mark.both_airflow_lines
def test_operator_conf_is_resolved_or_fails_without_retry() -> None:
    """Arbitrary JSON in a run's conf and params gives the operator a valid run key and boolean options, or makes execute fail with AirflowFailException (no retry) before touching a database."""
    tally: Counter[str] = Counter()

    @settings(FUZZ, max_examples=200)
    @given(
        conf=st.dictionaries(st.sampled_from(["run_key", "force", "dry_run", "other"]), JSON)
        | st.fixed_dictionaries({"run_key": RUN_KEY_INPUT})
        | st.fixed_dictionaries(
            {"run_key": st.dates(dt.date(1000, 1, 1), dt.date(2025, 12, 31)).map(str)},
            optional={"force": FLAG_INPUT, "dry_run": FLAG_INPUT},
        ),
        params=st.dictionaries(st.sampled_from(["run_key", "force", "dry_run"]), JSON),
        run_type=RUN_TYPES,
        logical_date=LOGICAL_DATES,
    )
    @example(
        conf={"run_key": "2026-10-01", "force": "true"},
        params={},
        run_type="manual",
        logical_date=None,
    )
    def check(
        conf: dict[str, Any], params: dict[str, Any], run_type: str, logical_date: Any
    ) -> None:
        dag_run = SimpleNamespace(conf=conf, run_type=run_type, logical_date=logical_date)
        context: Any = {"dag_run": dag_run, "params": params, "logical_date": logical_date}
        try:
            resolved = FUZZ_OPERATOR.resolve_run_key(context)
            options = FUZZ_OPERATOR.run_options(context)
        except InvalidInputError:
            tally["refused"] += 1
            with pytest.raises(AirflowFailException):
                FUZZ_OPERATOR.execute(context)  # refused before the hook is even created
            assert "hook" not in FUZZ_OPERATOR.__dict__
            return
        tally["accepted"] += 1
        assert check_text(resolved.run_key, "run key") == resolved.run_key
        assert isinstance(options.force, bool) and isinstance(options.dry_run, bool)

    check()
    tallied("operator conf", tally)


# -- job names and run keys through run_idempotently ----------------------------------------


@pytest.fixture(scope="module")
def fuzz_dsn(pg_server: Any) -> Iterator[str]:
    """One database for the module; each example empties the tables it uses."""
    with temporary_database(pg_server, "idem_fuzz") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ensure_schema(conn)
        yield dsn


def empty(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE idempotency.job_runs, idempotency.job_run_attempts,"
            " idempotency.outbound_ledger CASCADE"  # and what refers to them (resolutions)
        )
        if conn.execute("SELECT to_regclass('accounting.invoices')").fetchone() != (None,):
            conn.execute("TRUNCATE accounting.invoices")


def table_rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def test_job_names_and_run_keys_round_trip_exactly_or_nothing_is_written(fuzz_dsn: str) -> None:
    """Arbitrary unicode job names and run keys are either stored and read back exactly by a completed run, or refused with InvalidInputError with no row written and the work never called."""
    tally: Counter[str] = Counter()

    @settings(FUZZ, max_examples=80)
    @given(job_name=ANY_TEXT, run_key=ANY_TEXT)
    @example(job_name="O'Brien\"; DROP TABLE job_runs; --", run_key="période ☃ 🎉")
    @example(job_name="fees 100%", run_key="50% off %s %d")  # once broke every log line
    @example(job_name="job\x00nul", run_key="2026-10-01")
    @example(job_name="job", run_key="\ud800")
    @example(job_name="\U0001f600" * MAX_KEY_LENGTH, run_key="\U0001f600" * MAX_KEY_LENGTH)
    def check(job_name: str, run_key: str) -> None:
        empty(fuzz_dsn)
        seen: list[tuple[str, str]] = []

        def work(run: RunContext) -> dict[str, str]:
            seen.append((run.job_name, run.run_key))
            return {"job": run.job_name, "key": run.run_key}

        try:
            result = run_once(fuzz_dsn, work, job=job_name, run_key=run_key)
        except InvalidInputError:
            tally["refused"] += 1
            assert seen == []
            assert table_rows(fuzz_dsn, "SELECT count(*) FROM idempotency.job_runs") == [(0,)]
            assert table_rows(fuzz_dsn, "SELECT count(*) FROM idempotency.job_run_attempts") == [
                (0,)
            ]
            return
        tally["accepted"] += 1
        assert result.outcome is RunOutcome.COMPLETED
        assert (result.job_name, result.run_key) == (job_name, run_key)
        assert seen == [(job_name, run_key)]
        assert table_rows(
            fuzz_dsn, "SELECT job_name, run_key, status, details FROM idempotency.job_runs"
        ) == [(job_name, run_key, "completed", {"job": job_name, "key": run_key})]
        assert table_rows(
            fuzz_dsn, "SELECT job_name, run_key, outcome FROM idempotency.job_run_attempts"
        ) == [(job_name, run_key, "completed")]
        assert advisory_locks(fuzz_dsn) == 0

    check()
    tallied("job names and run keys", tally)


# -- idempotency keys and payloads through the ledger ---------------------------------------


@pytest.fixture(scope="module")
def fuzz_service(fuzz_dsn: str) -> Iterator[Any]:
    from devtools.accounting import run_accounting_service

    with run_accounting_service(fuzz_dsn) as service:
        yield service


# Printable ASCII (what an HTTP header carries), plus refusable shapes: blanks, controls,
# over-long keys.
VALID_KEY = st.from_regex(r"[!-~]([ -~]{0,38}[!-~])?", fullmatch=True)
ASCII_KEY = st.one_of(
    VALID_KEY,
    VALID_KEY.map(lambda k: f"invoice:2026-10-01:{k}"),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=3).map(
        lambda t: f"{t} "
    ),
    st.text(st.characters(max_codepoint=0x7F), min_size=1, max_size=10),  # controls too
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=199, max_size=202),
)
PAYLOAD = st.dictionaries(st.text(max_size=10), JSON, max_size=5)


def send(dsn: str, url: str, effects: list[Effect], calls: list[str]) -> Any:
    """send_all inside one forced run; return the summary or raise what send_all raised.

    ``calls`` gets the key of every request the ledger makes (counted on the client side:
    the service's own counters lag by up to 0.1 s).
    """
    box: dict[str, Any] = {}
    post = post_json("/api/invoices")

    async def counting(client: Any, effect: Effect) -> Any:
        calls.append(effect.idempotency_key)
        return await post(client, effect)

    def work(run: RunContext) -> None:
        retries = Retries(backoff_initial=0.01, backoff_max=0.05)
        ledger = OutboundLedger(run, "accounting", retries=retries)
        box["summary"] = ledger.send_all(effects, counting, base_url=url)

    run_once(dsn, work, job="fuzz", force=True)
    return box["summary"]


def test_idempotency_keys_and_payloads_are_sent_once_or_refused_with_nothing_written(
    fuzz_dsn: str, fuzz_service: Any
) -> None:
    """Arbitrary ASCII idempotency keys and JSON payloads are either sent once (the remote holds exactly that payload, the ledger its reference; a second send calls nothing) or refused with InvalidInputError before any row or request."""
    tally: Counter[str] = Counter()

    @settings(FUZZ, max_examples=60)
    @given(
        items=st.lists(st.tuples(ASCII_KEY, PAYLOAD), min_size=1, max_size=4),
        repeat=st.booleans(),
    )
    @example(items=[("k", {"a": 1}), ("k", {"a": 1})], repeat=False)  # a key twice in a batch
    @example(items=[("x" * 200, {"big": 2**70, "neg": -0.0, "u": "☃\u2028"})], repeat=True)
    def check(items: list[tuple[str, dict[str, Any]]], repeat: bool) -> None:
        empty(fuzz_dsn)
        effects = [Effect(key, payload) for key, payload in items]
        calls: list[str] = []
        try:
            summary = send(fuzz_dsn, fuzz_service.url, effects, calls)
        except InvalidInputError as exc:
            tally["refused"] += 1
            assert not isinstance(exc, IdempotencyKeyConflictError)  # fresh tables: no reuse
            assert calls == []
            assert table_rows(fuzz_dsn, "SELECT count(*) FROM idempotency.outbound_ledger") == [
                (0,)
            ]
            assert table_rows(fuzz_dsn, "SELECT count(*) FROM accounting.invoices") == [(0,)]
            return
        tally["accepted"] += 1
        tally["effects sent"] += len(effects)
        assert (summary.sent, summary.failed, summary.pending) == (len(effects), 0, 0)
        ledger = table_rows(
            fuzz_dsn,
            "SELECT idempotency_key, status, remote_reference, call_count"
            ' FROM idempotency.outbound_ledger ORDER BY idempotency_key COLLATE "C"',
        )
        remote = table_rows(
            fuzz_dsn,
            "SELECT idempotency_key, 'ACC-' || repeat('0', greatest(0, 6 - length(id::text)))"
            " || id::text, invoice::text"
            ' FROM accounting.invoices ORDER BY idempotency_key COLLATE "C"',
        )
        assert [(k, s, c) for k, s, _, c in ledger] == sorted(
            (e.idempotency_key, "succeeded", 1) for e in effects
        )
        assert [(k, ref) for k, ref, _ in remote] == [(k, ref) for k, _, ref, _ in ledger]
        sent = {e.idempotency_key: e.request for e in effects}
        assert {k: json.loads(body) for k, _, body in remote} == sent
        assert sorted(calls) == sorted(sent)  # one request per key
        if repeat:
            again = send(fuzz_dsn, fuzz_service.url, effects, calls)
            assert (again.sent, again.skipped_existing) == (0, len(effects))
            assert sorted(calls) == sorted(sent)  # not one more request

    check()
    tallied("ledger keys and payloads", tally)


# -- bugs the fuzzing found (fixed in 70ef64c), kept as regression tests ------------------


@pytest.mark.parametrize(
    ("period", "key"), [("day", "9999-12-31"), ("hour", "9999-12-31T23Z"), ("week", "9999-W52")]
)
def test_a_run_key_in_the_last_period_of_year_9999_is_refused_as_invalid_input(
    period: Any, key: str
) -> None:
    """A run_key whose period ends after year 9999 is refused with InvalidRunKeyError like any other impossible key."""
    with pytest.raises(InvalidRunKeyError) as refused:
        resolve_run_key(
            RunKeyRule(period=period),
            RunFacts(
                timezone="UTC",
                timetable_name="CronTriggerTimetable",
                run_type="manual",
                logical_date=None,
                conf_run_key=key,
                now=dt.datetime(2026, 10, 2, tzinfo=dt.timezone.utc),
            ),
        )
    figures(refusal(refused.value))


@pytest.mark.both_airflow_lines
def test_the_operator_fails_a_far_future_run_key_without_retry() -> None:
    """A manual run with conf run_key 9999-12-31 fails with AirflowFailException (no retry) before touching a database."""
    dag_run = SimpleNamespace(conf={"run_key": "9999-12-31"}, run_type="manual", logical_date=None)
    with pytest.raises(AirflowFailException) as refused:
        context = {"dag_run": dag_run, "params": {}, "logical_date": None}
        FUZZ_OPERATOR.execute(cast(Context, context))
    figures(f"{refusal(refused.value)} (a failure Airflow does not retry)")


def test_a_non_ascii_idempotency_key_is_refused_before_anything_is_written(
    fuzz_dsn: str, fuzz_service: Any
) -> None:
    """A non-ASCII idempotency key is refused with InvalidInputError before any ledger row or request."""
    empty(fuzz_dsn)
    calls: list[str] = []
    effects = [Effect("invoice:2026-10-01:order_1", {"n": 1}), Effect("facture:été:2", {"n": 2})]
    with pytest.raises(InvalidInputError) as refused:
        send(fuzz_dsn, fuzz_service.url, effects, calls)
    assert table_rows(fuzz_dsn, "SELECT count(*) FROM idempotency.outbound_ledger") == [(0,)]
    assert calls == []
    figures(f"{refusal(refused.value)}; 0 ledger rows, 0 requests (the valid key beside it unsent)")


def test_a_percent_sign_in_a_job_name_or_run_key_is_logged_verbatim(
    fuzz_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A job name and run key containing '%' run to completion and appear verbatim in the run's log lines."""
    import logging

    empty(fuzz_dsn)
    caplog.set_level(logging.INFO, logger="airflow_idempotency")
    result = run_once(fuzz_dsn, lambda run: {"ok": 1}, job="fees 100%", run_key="50% off")
    assert result.outcome is RunOutcome.COMPLETED
    line = f"job=fees 100% run_key=50% off attempt={result.attempt_id} started"
    assert line in caplog.text
    figures(f"completed; logged verbatim: {line!r}")


@pytest.mark.both_airflow_lines
@pytest.mark.usefixtures("airflow_home")
def test_an_operator_whose_job_name_has_a_percent_sign_completes(airflow_pg_conn: str) -> None:
    """An IdempotentRunOperator with job_name 'fees 100%' runs its work and completes under Airflow's own task logger."""
    from support.dag_runs import SUCCESS, run_dag, task_states

    calls: list[str] = []
    with DAG(
        "fuzz_percent_job",
        schedule="@daily",
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
    ) as dag:
        IdempotentRunOperator(
            task_id="work",
            job_name="fees 100%",
            python_callable=lambda run: calls.append(run.run_key),
            retries=0,
        )
    dag_run = run_dag(dag, logical_date=dt.datetime(2026, 10, 2, 1, tzinfo=dt.timezone.utc))
    assert dag_run.state == SUCCESS, task_states(dag_run)
    # "@daily": the run fired at 10-02 processes 10-01 on 3.x; logical date 10-02 is 10-02 on 2.x.
    assert calls == ["2026-10-01" if AIRFLOW_V_3_0_PLUS else "2026-10-02"]
    assert table_rows(airflow_pg_conn, "SELECT status FROM idempotency.job_runs") == [
        ("completed",)
    ]
    figures(
        f"DAG run {dag_run.state}; the work ran once, for run key {calls[0]}; job_runs: completed"
    )
