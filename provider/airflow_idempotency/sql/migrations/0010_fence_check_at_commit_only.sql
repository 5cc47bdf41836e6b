-- Version 10: the fence's commit-time check runs at COMMIT or not at all (issue 30, adversary).
--
-- The check is a DEFERRABLE INITIALLY DEFERRED constraint trigger (migration 6), and SET
-- CONSTRAINTS ALL IMMEDIATE (or SET CONSTRAINTS fence_at_commit IMMEDIATE) in the work's own
-- transaction makes it fire early: at that statement, or at once in fence_enter()/fence_arm().
-- It then passed while the lock was still held and the real COMMIT, after the lock was lost,
-- ran no check: the work's rows landed. Now the check refuses (IF004) when it fires in any
-- statement but a COMMIT (or END): nothing of the transaction commits, and the error says to
-- name the work's own constraints in SET CONSTRAINTS instead of ALL. current_query() is the
-- statement the client sent, as for PREPARE TRANSACTION (migration 8).

CREATE OR REPLACE FUNCTION fence_check_at_commit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_query() ~* '\mprepare\s+transaction\M' THEN
        RAISE EXCEPTION 'a fenced transaction of attempt % may not be prepared (two-phase commit)',
            NEW.attempt_id
            USING ERRCODE = 'IF003',
                  HINT = 'its COMMIT PREPARED could land after the run lock is lost; commit it '
                         'directly';
    END IF;
    IF current_query() !~* '^\s*(commit|end)\M' THEN
        RAISE EXCEPTION 'the commit-time check of a fenced transaction of attempt % ran before '
                        'its COMMIT (SET CONSTRAINTS ALL IMMEDIATE)', NEW.attempt_id
            USING ERRCODE = 'IF004',
                  HINT = 'its COMMIT would then run no check and could land after the run lock '
                         'is lost; name the work''s own constraints in SET CONSTRAINTS instead '
                         'of ALL';
    END IF;
    IF NOT run_lock_held_by(NEW.lock_key, NEW.lock_backend_pid, NEW.lock_holder) THEN
        RAISE EXCEPTION 'run lock % was lost before this transaction of attempt % could commit',
            NEW.lock_key, NEW.attempt_id
            USING ERRCODE = 'IF001',
                  HINT = 'the transaction was rolled back; a rerun converges';
    END IF;
    RETURN NULL;
END
$$;
