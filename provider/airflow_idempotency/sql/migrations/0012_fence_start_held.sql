-- Version 12: a start is fenced by its own lock (issue 30; found by the model of the fence,
-- tests/model/fence.pml, docs/fence.md "An exhaustive check").
--
-- fence_take_over(lock_key, wait_ms) took the key's fence lock exclusively and forgot the
-- earlier attempts' arms, but never checked that the starting attempt still held its run lock.
-- An attempt whose lock session ended between taking the run lock and its start could commit
-- that start after its successor's: it closed the successor's attempt as abandoned and made
-- itself the run's current attempt, so the successor's completion was refused and the key was
-- left not completed. This overload takes the attempt's lock holder (pid, virtual xid) and,
-- once it holds the fence key exclusively, refuses (IF001) unless that lock transaction still
-- holds the run lock. A successor's start takes the same fence key exclusively, so it waits for
-- this start's transaction: a start that passed the check commits before any successor's start.
-- The two-argument function stays for workers of version 11 and older (a rolling upgrade).

CREATE OR REPLACE FUNCTION fence_take_over(
    p_lock_key bigint, p_wait_ms integer, p_lock_backend_pid integer, p_lock_holder text
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM fence_take_over(p_lock_key, p_wait_ms);
    IF NOT run_lock_held_by(p_lock_key, p_lock_backend_pid, p_lock_holder) THEN
        RAISE EXCEPTION 'run lock % is no longer held by the session that took it (backend %): '
                        'this attempt may not start', p_lock_key, p_lock_backend_pid
            USING ERRCODE = 'IF001',
                  HINT = 'the lock session ended before the start was recorded; nothing was '
                         'written; a rerun converges';
    END IF;
END
$$;
