"""A run key's output file, written through the contract: whole or not at all, once per content.

    with OutputFile(run, "exports/2026-10-01.csv", root="/data/out") as out:
        out.write_text(csv_text)
    # the file is in place now, under its final name; before, it was not touched

The content goes to a temporary name beside the final one (``.<name>.<attempt>.<token>.partial``)
and is moved into place (an atomic rename) only when the block exits without an error: the
commit. The rename (and the restore of a committed file changed by hand) happens under the
fence: inside a fenced transaction, so only while the run holds its lock, and a successor
taking the key over waits until it is done. The file is an effect in the outbound ledger
(kind ``file``, remote system ``files:<root>``, key the path below the root), fingerprinted
by its content's SHA-256:

- a rerun of a key whose file was committed with the same content leaves it untouched
  (content, modification time, inode): the rename is skipped;
- different content for a file already committed is refused (:class:`OutputConflictError`,
  like a changed request under an existing idempotency key), unless the run is forced: a
  forced rerun replaces the file, atomically;
- a crash before the commit leaves the final file as it was (and a ``.partial`` file, removed by
  the next commit of that output); a crash after the rename, before the ledger recorded it,
  leaves a ``pending`` row, and the rerun commits its own content (the key never completed);
- a path outside ``root`` (``..``, an absolute path elsewhere, a symlink out) is refused before
  anything is written.

``path`` and ``root`` are local paths or Airflow ``ObjectStoragePath`` objects (``s3://``,
``gs://``, ``file://`` ...): on object stores the "rename" is the store's copy of the whole
object, so readers see the old object or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from airflow_idempotency._sql import query
from airflow_idempotency.crashpoints import crash_point
from airflow_idempotency.exceptions import (
    IdempotencyKeyConflictError,
    InvalidInputError,
    OutputConflictError,
    PermanentRemoteError,
)
from airflow_idempotency.ledger import LedgerScope, OutboundLedger, Retries
from airflow_idempotency.ledger.senders import Confirmation, Effect, EffectSender


def _is_object_storage(path: Any) -> bool:
    return hasattr(path, "fs") and hasattr(path, "protocol") and not isinstance(path, os.PathLike)


class _Location:
    """Where an output goes, local or object storage, behind the few operations it needs."""

    def __init__(self, root: Any, path: Any, what: str) -> None:
        self.object_storage = _is_object_storage(root)
        if self.object_storage:
            self.root, self.final, self.relative = _object_paths(root, path, what)
        else:
            self.root, self.final, self.relative = _local_paths(root, path, what)

    @property
    def name(self) -> str:
        return str(self.final.name)

    def sibling(self, name: str) -> Any:
        return self.final.parent / name

    def exists(self, path: Any) -> bool:
        return bool(path.exists())

    def sha256(self, path: Any) -> str | None:
        if not path.exists():
            return None
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def make_parent(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)

    def replace(self, source: Any) -> None:
        """Move ``source`` over the final name (atomic locally; a whole-object copy on stores)."""
        if self.object_storage:
            source.rename(self.final)
            return
        os.replace(source, self.final)
        directory = os.open(self.final.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)

    def remove(self, path: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def leftovers(self) -> list[Any]:
        """Temporary files of this output left by attempts that did not commit."""
        return list(self.final.parent.glob(f".{self.name}.*.partial"))


def _local_paths(root: Any, path: Any, what: str) -> tuple[Path, Path, str]:
    base = Path(root).resolve()
    final = (base / Path(path)).resolve()  # resolve(): a symlink cannot lead out of the root
    try:
        relative = final.relative_to(base)
    except ValueError:
        raise InvalidInputError(
            f"{what}: {os.fspath(path)!r} is outside the allowed root {str(base)!r}; write "
            "below it (a relative path, without '..'), or give another root"
        ) from None
    if not relative.parts:
        raise InvalidInputError(f"{what}: {os.fspath(path)!r} names the root itself, not a file")
    return base, final, relative.as_posix()


def _object_paths(root: Any, path: Any, what: str) -> tuple[Any, Any, str]:
    final = path if _is_object_storage(path) else root / str(path)
    root_path = posixpath.normpath(str(root.path))
    final_path = posixpath.normpath(str(final.path))
    inside = final_path.startswith(root_path.rstrip("/") + "/")
    if final.protocol != root.protocol or not inside or ".." in str(final.path).split("/"):
        raise InvalidInputError(
            f"{what}: {str(final)!r} is outside the allowed root {str(root)!r}; write below it"
        )
    return root, final, final_path[len(root_path.rstrip("/")) + 1 :]


class _FileSender(EffectSender[None]):
    """The commit of one staged output: the ledger's "call" is the rename."""

    kind = "file"
    deduplicating = True  # replacing a file by the same content is harmless
    concurrency = 1

    def __init__(self, output: OutputFile) -> None:
        self.output = output
        self.location = output.location
        self.staged = output.staged
        self.target = str(output.location.final)

    async def connect(self) -> None:
        return None

    async def send(self, connection: None, effect: Effect) -> Confirmation:
        try:
            with self.output.under_fence():
                self.location.replace(self.staged)
        except OSError as exc:
            raise PermanentRemoteError(f"cannot move {self.staged} into place: {exc}") from exc
        crash_point("files.after_rename")
        return Confirmation(f"sha256:{effect.request['sha256']}")


class OutputFile:
    """The output file ``path`` (below ``root``) of the current run key; see the module doc.

    Use it as a context manager and write with :meth:`write_bytes`, :meth:`write_text` or
    :meth:`open`; the file is committed when the block exits without an error (or by
    :meth:`commit`). ``commit`` returns ``"written"``, ``"unchanged"`` (same content
    already committed: untouched) or ``"would write"`` (a dry run: nothing written).
    """

    def __init__(self, run: LedgerScope, path: Any, *, root: Any) -> None:
        self.run = run
        self.what = f"output file {str(path)!r} of job {run.job_name!r} run key {run.run_key!r}"
        self.location = _Location(root, path, self.what)
        self.remote_system = f"files:{self.location.root}"
        token = secrets.token_hex(4)
        attempt = run.attempt_id if run.attempt_id is not None else "x"
        self.staged = self.location.sibling(f".{self.location.name}.{attempt}.{token}.partial")
        self._file: Any = None
        self.outcome: str | None = None

    # -- writing ------------------------------------------------------------------------

    def open(self, mode: str = "wb", **kwargs: Any) -> Any:
        """The staged file, open for writing (``wb`` or ``w``); closed by :meth:`commit`."""
        if mode not in ("wb", "w"):
            raise InvalidInputError(f"{self.what}: open it with 'wb' or 'w', not {mode!r}")
        if self._file is None:
            self.location.make_parent()
            self._file = self.staged.open(mode, **kwargs)
        return self._file

    def write_bytes(self, data: bytes) -> None:
        self.open("wb").write(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def discard(self) -> None:
        """Drop what was staged; the final file stays as it was."""
        self._close()
        self.location.remove(self.staged)

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            with contextlib.suppress(AttributeError, OSError, ValueError):
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    # -- committing ---------------------------------------------------------------------

    def commit(self) -> str:
        """Move the staged content into place through the ledger (see the module doc)."""
        if self._file is None:
            self.open("wb")  # an empty output is still an output
        self._close()
        crash_point("files.after_write")
        sha = self.location.sha256(self.staged)
        assert sha is not None
        effect = Effect(self.location.relative, {"path": self.location.relative, "sha256": sha})
        try:
            self.outcome = self._commit(effect, sha)
        finally:
            self.location.remove(self.staged)
        return self.outcome

    def _commit(self, effect: Effect, sha: str) -> str:
        if self.run.dry_run:
            self._send(effect)  # classifies, writes nothing (raises on a conflict)
            self.run.log.info("dry run: %s would be written (sha256 %s)", self.what, sha[:12])
            return "would write"
        self._restage(effect)
        summary = self._send(effect)
        for leftover in self.location.leftovers():
            if str(leftover) != str(self.staged):
                self.location.remove(leftover)
        if summary.sent:
            self.run.log.info("%s: written (sha256 %s)", self.what, sha[:12])
            return "written"
        if self.location.sha256(self.location.final) != sha:  # deleted or changed by hand
            with self.under_fence():
                self.location.replace(self.staged)
            self.run.log.warning("%s: restored the committed content (it was changed)", self.what)
            return "written"
        self.run.log.info("%s: unchanged (same content committed before): untouched", self.what)
        return "unchanged"

    def _send(self, effect: Effect) -> Any:
        ledger = OutboundLedger(self.run, self.remote_system, retries=Retries(max_attempts=1))
        try:
            return ledger.send_all([effect], _FileSender(self))
        except IdempotencyKeyConflictError as exc:
            current = self.location.sha256(self.location.final)
            raise OutputConflictError(
                f"{self.what} was committed before with other content (now sha256 "
                f"{(current or 'missing')[:12]}, this run's {effect.request['sha256'][:12]}): "
                "refused, the file is untouched. Its content must not change for one run key; "
                "rerun with force=true to replace it on purpose."
            ) from exc

    @contextlib.contextmanager
    def under_fence(self) -> Iterator[None]:
        """Hold the run's fence while the block moves a file into place: a fenced
        transaction is open on a connection of its own meanwhile, so the block runs only
        while this attempt holds the run lock (else :class:`LockLostError`, nothing moved),
        and a successor taking the key over waits until it has ended (docs/fence.md)."""
        with self.run.bookkeeping_connection() as conn:
            try:
                with self.run.fenced_transaction(conn):
                    yield
            except psycopg.Error as exc:
                raise self.run.translate_error(exc, conn) from exc

    def _restage(self, effect: Effect) -> None:
        """Let this content replace what an earlier attempt staged but never committed (a
        ``pending`` row) and, in a forced run, what was committed: the row takes this
        content's fingerprint, fenced like every write of the run."""
        with self.run.bookkeeping_connection() as conn:
            try:
                with self.run.fenced_transaction(conn):
                    conn.execute(
                        query("ledger_restage_output", self.run.schema),
                        {
                            "remote_system": self.remote_system,
                            "key": effect.idempotency_key,
                            "fingerprint": effect.fingerprint,
                            "force": bool(getattr(self.run, "force", False)),
                            "attempt_id": self.run.attempt_id,
                        },
                    )
            except psycopg.Error as exc:
                raise self.run.translate_error(exc, conn) from exc
