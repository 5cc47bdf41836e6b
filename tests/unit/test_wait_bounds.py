"""Every lock or connection wait the provider can enter has a bound (issue 30, item 1).

The provider's source is read, not trusted: every place that begins a transaction, takes a
connection or waits for an advisory lock (found with ``ast``) must be listed in :data:`SITES`
with what bounds its waits; a new site that nobody looked at fails the test, and so does a
listed site that is gone. In the SQL, every function the queries call that can wait for a
lock sets ``lock_timeout`` before it waits. Real PostgreSQL proves the bounds themselves:
tests/integration/test_fence_nesting.py and tests/integration/test_lock_wait_bounds.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "provider" / "airflow_idempotency"
SQL = PACKAGE / "sql"

_FENCED = "fence_enter tries the fence key first and bounds its wait (lock_timeout, 0008)"
_BOUNDED = "bounded_transaction: lock_timeout = AIRFLOW_IDEMPOTENCY_LOCK_WAIT for it"

SITES: dict[tuple[str, str, str], str] = {
    # (module, enclosing function, what is called): what bounds the waits there
    ("_transactions.py", "bounded_transaction", "transaction"): _BOUNDED,
    ("records.py", "start_attempt", "in_one_transaction"): "fence_take_over tries first, then "
    "lock_timeout for the whole start (IF002 names the sessions it waited for)",
    ("locks.py", "_begin_and_try", "BEGIN"): "acquire_run_lock sets lock_timeout for the "
    "whole lock transaction; the run lock itself is only ever tried",
    ("fence.py", "transaction", "explicit_transaction"): _FENCED,
    ("fence.py", "transaction", "transaction"): _FENCED + " (a savepoint of an open one)",
    ("run_context.py", "transaction", "transaction"): _FENCED + "; the work's own "
    "statements keep the work's lock_timeout",
    ("run_context.py", "fenced_transaction", "transaction"): _FENCED + ", and bound_locks: "
    "lock_timeout for every statement (the ledger's)",
    ("run_steps.py", "_start_and_work", "transaction"): "the dry run's outer transaction: "
    "BEGIN only, the work's statements in it are the work's own",
    ("run_failures.py", "_write_in_lock_transaction", "bounded_transaction"): _BOUNDED,
    ("run_failures.py", "_write_fresh", "bounded_transaction"): _BOUNDED,
    ("run_failures.py", "_write_fenced", "transaction"): _FENCED + ", and bound_locks (the "
    "lease mode's failure record)",
    ("leases.py", "acquire_lease", "in_one_transaction"): "bound_lock_waits first: "
    "lock_timeout for the lease's transaction; the advisory run lock is only tried",
    ("leases.py", "renew_lease", "in_one_transaction"): "bound_lock_waits first (the heartbeat)",
    ("lease_run.py", "_run_lease", "bounded_transaction"): _BOUNDED + " (a lease-mode dry run's "
    "record)",
    ("lease_run.py", "_complete_and_release", "BEGIN"): _FENCED + ", and bound_lock_waits "
    "(the lease mode's completion, and its release at COMMIT by a trigger, migration 19)",
    ("lease_run.py", "_completed_after_all", "in_one_transaction"): "bound_lock_waits first "
    "(the read-back of a lost completion's outcome, adv34)",
    ("ledger/pipeline.py", "_write_intents", "bounded_transaction"): _BOUNDED,
    ("effects/notifications.py", "fenced_transaction", "bounded_transaction"): _BOUNDED,
    ("retention.py", "prune_attempts", "bounded_transaction"): _BOUNDED,
    ("adoption.py", "_adopt", "bounded_transaction"): _BOUNDED + "; the key's run lock is "
    "only tried (adopt_lock)",
    ("ui/reads.py", "snapshot", "BEGIN"): "statement_timeout for the page's transaction",
    ("ui/database.py", "pool", "ConnectionPool"): "the pool's timeout (pool_timeout) and "
    "connect_timeout",
    ("ui/database.py", "open_reader", "connection"): "the pool's timeout (PoolTimeout)",
    ("connection.py", "new_connection", "connect"): "connect_timeout (CONNECT_TIMEOUT unless set)",
    ("hook.py", "new_connection", "connect"): "connect_timeout (connection.connect_kwargs)",
    ("cli/_database.py", "connect", "connect"): "connect_timeout (CONNECT_TIMEOUT unless the DSN "
    "sets one)",
    ("ledger/deduplicating.py", "_open", "ConnectionPool"): "a pool of the remote's "
    "connections: no database wait; each call is bounded by its sender's timeout",
    ("ledger/pipeline.py", "_serve", "ConnectionPool"): "as above",
    ("ledger/calls.py", "_try", "connection"): "as above",
    ("migrator.py", "_try", "BEGIN"): "lock_timeout and idle_in_transaction_session_timeout, "
    "set by begin_migration, the try's first statement; tries end within "
    "MigrationBounds.give_up_after (MigrationBlockedError)",
    ("migrator.py", "_try", "transaction"): "as above",
    ("migrator.py", "migration_blockers", "transaction"): "reads pg_locks and "
    "pg_stat_activity only: no lock to wait for",
}

KNOWN_UNBOUNDED: dict[tuple[str, str, str], str] = {
    ("migrator.py", "applied_migrations", "transaction"): "a probe: reads schema_version only "
    "(inside a migration's try, under its lock_timeout)",
    ("schema.py", "current_version", "transaction"): "a probe: reads schema_version only",
}

_CALLS = {
    "transaction",
    "in_one_transaction",
    "explicit_transaction",
    "bounded_transaction",
    "ConnectionPool",
    "connection",
}
_WAITING_LOCK = re.compile(r"pg_advisory_(xact_)?lock(_shared)?\s*\(|\bLOCK\s+TABLE\b", re.I)


def _called(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name == "connect" and isinstance(func, ast.Attribute):
        owner = func.value
        return "connect" if isinstance(owner, ast.Name) and owner.id == "psycopg" else None
    return name if name in _CALLS else None


def _strings(node: ast.Call) -> list[str]:
    return [
        arg.value
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    ]


def wait_sites() -> set[tuple[str, str, str]]:
    """(module, enclosing function, what is called) of every site in the provider's source."""
    found: set[tuple[str, str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                called = _called(node)
                if called:
                    found.add((module, function.name, called))
                for text in _strings(node):
                    if text.lstrip().upper().startswith("BEGIN"):
                        found.add((module, function.name, "BEGIN"))
                    match = _WAITING_LOCK.search(text)
                    if match:
                        found.add((module, function.name, match.group(0).rstrip("( ")))
    return found  # a call in a nested function is found under both functions


def test_every_wait_site_of_the_provider_is_bounded() -> None:
    """Each transaction, connection or lock wait the provider's source can enter is one whose
    bound was checked (SITES says what bounds it); none is new and none listed is gone."""
    found = wait_sites()
    listed = set(SITES) | set(KNOWN_UNBOUNDED)
    unlisted = found - listed
    assert not unlisted, (
        f"wait sites with no known bound: {sorted(unlisted)}. Bound each (bounded_transaction, "
        "a fenced transaction, lock_timeout, connect_timeout) and list it in SITES with what "
        "bounds it"
    )
    assert not listed - found, f"listed sites that no longer exist: {sorted(listed - found)}"


def _functions(text: str) -> list[tuple[str, str]]:
    """(name, body) of each function a SQL file creates."""
    pattern = re.compile(
        r"CREATE (?:OR REPLACE )?FUNCTION\s+(\w+)\s*\((.*?)AS \$\$(.*?)\$\$", re.S | re.I
    )
    return [(m.group(1), m.group(2) + m.group(3)) for m in pattern.finditer(text)]


def current_functions() -> dict[str, list[str]]:
    """The bodies (with their headers) of each function name, from the newest migration that
    creates it: older overloads stay for workers of earlier versions and are not called."""
    latest: dict[str, list[str]] = {}
    for path in sorted((SQL / "migrations").glob("*.sql")):
        seen: dict[str, list[str]] = {}
        for name, body in _functions(path.read_text(encoding="utf-8")):
            seen.setdefault(name, []).append(body)
        latest.update(seen)
    return latest


def test_every_sql_function_the_queries_call_bounds_its_lock_waits() -> None:
    """Each function sql/queries.sql calls (and each it calls in turn) that waits for a lock sets
    lock_timeout before it waits; no query waits for a lock on its own."""
    queries = (SQL / "queries.sql").read_text(encoding="utf-8")
    assert not _WAITING_LOCK.search(queries.replace("pg_try_advisory", "")), (
        "a query waits for a lock: try it, or call a function that bounds the wait"
    )
    functions = current_functions()
    todo = set(re.findall(r"\{schema\}\.(\w+)\(", queries)) & set(functions)
    checked: set[str] = set()
    while todo:
        name = todo.pop()
        checked.add(name)
        for body in functions[name]:
            for match in _WAITING_LOCK.finditer(body):
                before = body[: match.start()]
                assert re.search(r"set_config\('lock_timeout'|SET lock_timeout", before), (
                    f"{name}() waits for a lock ({match.group(0)}) with no lock_timeout set "
                    "before it"
                )
            todo |= {f for f in functions if re.search(rf"\b{f}\(", body)} - checked
    assert {"fence_enter", "fence_take_over"} <= checked


def test_the_scan_finds_a_site_without_a_bound(tmp_path: Path) -> None:
    """The scan is a witness: an unbounded transaction and a waiting lock in a module are
    found (so a new one in the provider would fail the test above)."""
    module = tmp_path / "new.py"
    module.write_text(
        "def export(conn):\n"
        "    with conn.transaction():\n"
        "        conn.execute('SELECT pg_advisory_xact_lock(1)')\n",
        encoding="utf-8",
    )
    tree = ast.parse(module.read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert "transaction" in {_called(node) for node in calls}
    assert any(_WAITING_LOCK.search(text) for node in calls for text in _strings(node))
