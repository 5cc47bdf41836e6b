/* The fence of airflow-provider-idempotency (docs/fence.md), as a model for spin.
 *
 * Two attempts of one run key, each with up to three fenced transactions, every interleaving:
 * the run lock (held by a lock transaction, named by its session's pid and its virtual
 * transaction id), the key's fence lock (shared by each fenced transaction, exclusive for a
 * start's takeover, with PostgreSQL's queue: a request waits behind a queued conflicting one),
 * the commit-time check, the loss of a lock session at any moment, and a successor whose lock
 * session reuses the lost one's pid. tests/unit/test_fence_model.py runs it with spin.
 *
 * Each step that is a statement of the provider names it: "sql: <name>" is a query of
 * provider/airflow_idempotency/sql/queries.sql (the test checks that each exists and that every
 * fence statement is modelled). The checksum below is that of the fence's SQL (the fence_*
 * queries, acquire_run_lock, start_attempt, complete_attempt and every migration that defines
 * a fence function: 0006, 0008, 0010, 0012, 0013, 0014, 0017, 0018, 0019, 0020): when the SQL changes, the test fails until the model is
 * reviewed and the checksum updated. Reviewed for 0010 (the commit-time check runs at COMMIT
 * or refuses: the model's check and commit are one step) and 0011 (start_attempt records the
 * attempt's provenance: no fence change) and 0012 (the start's check of its own lock, modelled
 * after the takeover's acquisition of the fence key) and 0013 (the same check again, in a
 * trigger on the start's INSERT, for workers of version 11 that send the two-argument takeover:
 * the model's attempts are of this version, whose start already checks under the fence key, so
 * the model's start step stands for both checks; an old worker's start, checked by pid alone,
 * is the -DPID_ONLY variant's start). Reviewed for 0014 (the lease mode, issue 32; the
 * -DLEASE variant below): run_lock_held_by answers a holder 'lease:<token>' from run_leases
 * (the token is the holder's identity, as the vxid is: every acquisition draws a new one, so
 * held_by(a) compares it; the pid plays no part), and the advisory path is unchanged; the
 * start trigger also refuses an advisory-mode start while a lease is live (the two modes on one
 * key: not modelled, the model's attempts are of one mode). Reviewed for 0016 (issue 32: the
 * decision in one call, sql: decide, whose run_decide() tries the run lock as acquire_run_lock
 * does: the lock step below stands for both; its read and the no-op's record write nothing the
 * model checks) and 0017 (the four-argument take-over marks its transaction once its check
 * passed, and the start trigger of 0013 skips its pg_locks reads for a marked start: the
 * model's start step is that check, made once under the exclusive fence key; an old worker's
 * start sets no mark and is checked by the trigger as before, the -DPID_ONLY variant's start).
 * Reviewed for sql: decide returning run_decide()'s row as one JSON text (row_to_json, issue
 * 32's client CPU): the same call with the same arguments in the same message after the same
 * BEGIN, so the lock step below stands for it unchanged; only the row's form changed.
 * Reviewed for 0018 (issue 32: a lease is held until taken over): run_lock_held_by answers a
 * lease from its token alone under READ COMMITTED (the model's checks are live reads, as they
 * are there), expiry only allows a take-over, a renewal revives an expired lease still the
 * holder's (-DLEASE below: LockLoss expires the lease instead of ending it); a REPEATABLE READ
 * transaction still needs the lease unexpired (its snapshot: not modelled); the start trigger
 * deletes an expired lease when an advisory-mode start takes its key (two modes on one key:
 * not modelled).
 * Reviewed for 0019 (issue 32: the lease mode's decision in one call, sql: decide_lease, whose
 * run_decide_lease() tries the key's advisory run lock, refuses a live lease and takes the
 * lease as lease_acquire does, in a transaction committed in the same message: the lock step
 * below stands for it; a completed key's no-op is recorded there WITHOUT a lease, under the
 * advisory run lock that every acquisition must take, with no lease live: the model's attempts
 * do work, and a no-op writes nothing the model checks. The completion (-DLEASE) now releases
 * the lease at its own COMMIT, by a deferred trigger queued after the fence's check
 * (sql: lease_release_at_commit): the release moves into the step where the completion lands,
 * after the check at COMMIT, instead of a step of its own after it; every property still
 * holds, and -DLEASE_COMPLETION_UNFENCED still fails).
 * Reviewed for 0020 (the lease mode's adversary pass: an advisory-mode start on a key whose
 * lease is live queued EXCLUSIVE for the fence key, stalling the lease holder's fenced
 * transactions for its whole lock wait): the four-argument take-over of a holder that is not a
 * lease reads fence_live_lease BEFORE it requests the fence key and refuses (IF001, as the
 * start trigger does). The properties are unaffected: in the model's advisory attempts no lease
 * exists, so the read refuses nothing and the start step is unchanged; under -DLEASE the holder
 * is 'lease:<token>', for which the read is skipped. Two modes on one key are not modelled.
 * Reviewed for sql: start_attempt reading the run again after its fence_take_over's wait (the
 * lease mode's late completion, tests/integration/test_lease_adversary.py): the statement now
 * reads job_runs (FOR UPDATE) under the exclusive fence key and, for a run completed and not
 * forced, records its attempt as a finished 'noop' and writes nothing else (no job_runs
 * take-over, no attempt closed as abandoned); the lease is then released (sql: lease_release),
 * the lock transaction committed. The fence's own statements are unchanged, so are the
 * properties above: the no-op start holds the fence key as a start does and commits nothing
 * the fence checks. Modelled, as a new property (the key's work completes once) and its
 * variant -DSTART_TAKES_COMPLETED: the decision's read refuses a completed key in the
 * acquisition step, the start step reads again (a no-op leaves by the failure's path: nothing
 * is open), and every landing of a completion asserts that none landed before.
 * Reviewed for sql: lease_release as one statement in autocommit (no transaction block, so
 * that a pooler in statement mode lets the release of a refused start through; its lock waits
 * bounded by a set_config local to the statement, evaluated before either DELETE): it deletes
 * the same rows under the same conditions (the lease only while its token stands, the spent
 * arms of its holder) in one atomic statement, as the model's release step does; nothing
 * else changed.
 * Reviewed for 0021 (issue 32: a cheaper decision): fence_live_lease and bound_dead_peer are
 * the same statements in plpgsql (whose plans a session keeps) instead of SQL functions that
 * every transaction planned again; run_decide reads the lock table once for this backend (the
 * key's run lock held already, the virtual transaction id) instead of twice, and assigns the
 * holder only after its try of the run lock, as before. Same reads, same results, same order
 * against every other statement: the model's steps and properties are unchanged.
 * Reviewed for the decide_lease query's result (issue 32: a cheaper decision): the same call of
 * run_decide_lease, between the same BEGIN and COMMIT in the same message, returns its row as
 * one JSON text (row_to_json), as decide does; the client reads the same fields. No statement
 * or order changed: the model is unchanged.
 * Reviewed for sql: lease_release as two statements in one simple-protocol message (adv34):
 * its set_config now runs as a statement of its own before the DELETE is parsed, so that the
 * tables' locks the DELETE takes at parse are bounded too (behind an ALTER TABLE queued behind
 * a long reader it waited without bound). The message's one implicit transaction deletes the
 * same rows under the same conditions (the lease only while its token stands, the spent arms
 * of its holder) at one commit, as the model's release step does; a release refused by its
 * lock wait deletes nothing, as a release that never came (the lease expires). Nothing else
 * changed: the model is unchanged.
 *
 * fence-sql-sha256: 7bebab557dfff161db9e6cf7cc3a187c4dad388fb80b6abb9aab9d3c740d4e44
 *
 * Properties (each a spin assertion, or spin's own check of end states):
 *  - no commit of an attempt's fenced transaction whose COMMIT was sent after its lock was lost;
 *  - no commit of an attempt after a successor's start committed;
 *  - no wait cycle through the worker's Python: a fenced enter queued behind a successor's
 *    takeover that waits for a transaction of the enter's own attempt (PostgreSQL cannot see
 *    that cycle);
 *  - no hang: every wait is bounded, so no state where the attempts wait forever;
 *  - the key's work completes once: no completion lands after another attempt's landed (the
 *    attempts are not forced: a completed key is a no-op, found by the decision's read or,
 *    when the completion landed after that read, by the start's).
 *
 * Variants that reintroduce a known defect (each must make spin report a violation):
 *  -DDEFECT1  the enter queues its shared fence lock behind a takeover, without a bound (main
 *             at b2bdd8d: issue 30, defect 1): the wait-cycle assertion fails;
 *  -DUNBOUNDED_TAKEOVER the takeover waits without a bound (main at b2bdd8d too): with
 *             DEFECT1 and NO_CYCLE_MONITOR, spin reports the hang (an invalid end state);
 *  -DDEFECT2  run.transaction() nested in the connection's own transaction arms no check at
 *             COMMIT (main at b2bdd8d: issue 30, defect 2);
 *  -DPID_ONLY the checks compare the lock session's pid only (pid reuse);
 *  -DNO_CYCLE_MONITOR leaves the wait-cycle assertion out (so that a hang shows as one).
 *
 * -DLEASE   the lease mode (docs/locks.md): the run lock is a lease, taken only when free or
 *             expired (sql: lease_acquire, the acquisition step: a new token is the new vxid),
 *             held until then (LockLoss expires it; its holder may renew it while nobody took
 *             it over, sql: lease_renew; lost only when a successor's acquisition draws a token),
 *             and the completion is not written in a lock transaction but in one more fenced
 *             transaction (sql: complete_attempt_lease: fence_enter at its BEGIN, the check at
 *             its COMMIT, the fence key shared in between), which releases the lease
 *             at its COMMIT, after the check (sql: lease_release_at_commit; a failed
 *             attempt's by sql: lease_release). Every property must hold; with
 *             -DLEASE_COMPLETION_UNFENCED (the completion's COMMIT unchecked, as if it were
 *             written outside the fence) a completion commits after its lease was lost; with
 *             -DLEASE_RENEW_UNCHECKED (a renewal that does not compare the token) an expired
 *             holder takes its key back from the successor that took it over.
 *
 * -DSTART_TAKES_COMPLETED the start takes over a run completed since the decision read it
 *             (main before the start's re-read): with -DLEASE, a completion that passed its
 *             check at COMMIT lands after a successor took the expired lease and read the run
 *             as started; that successor's start waits for it, takes the completed run over
 *             and does the work again (tests/integration/test_lease_adversary.py). The
 *             advisory mode holds even so (its read follows the landing, which releases the lock).
 *
 * -DSTART_UNCHECKED the start does not check, under the fence key it holds exclusively, that
 *             its attempt still holds the run lock (main before migration 0012): an attempt whose
 *             lock session ended between acquire_run_lock and its start commits that start after
 *             its successor's and takes job_runs over from it; the start-order assertion fails.
 *             Found by this model (docs/fence.md, "An exhaustive check").
 */

#define NTX 3

/* the run lock: pg_try_advisory_xact_lock, held by one lock transaction at a time */
bool run_locked;
byte lock_owner;                 /* the attempt whose lock transaction holds it (ghost) */
byte lock_pid;                   /* pg_locks.pid of the holder */
byte lock_vxid;                  /* pg_locks.virtualtransaction of the holder */
byte next_vxid = 1;
bool lease_expired;              /* -DLEASE: the lease expired; a successor may take it over */
bool session_alive[3];           /* [attempt] its lock session is still open */
byte session_pid[3];             /* [attempt] its lock session's pid */
byte rec_pid[3];                 /* [attempt] the holder it recorded (RunLock.params) */
byte rec_vxid[3];

/* the key's fence lock (an advisory lock in the (int4, int4) space) */
byte fence_shared;               /* granted shared locks */
bool fence_exclusive;            /* granted exclusive (a start's takeover) */
byte excl_waiting;               /* takeovers queued for it */

/* ghosts, for the properties */
byte acquisitions;
byte acquired[3];                /* [attempt] the order in which it took the run lock, 0: never */
bool started[3];                 /* [attempt] its start committed */
bool completed;                  /* a completion landed: job_runs.status = 'completed' */
bool enter_waits[3];             /* [attempt] an enter of it is queued for the fence lock */
bool takeover_waits[3];          /* [attempt] its takeover is queued */
byte open_shared[3];             /* [attempt] fence locks held by its open transactions */

#ifdef PID_ONLY
#define held_by(a) (run_locked && lock_pid == rec_pid[a])
#else
#define held_by(a) (run_locked && lock_pid == rec_pid[a] && lock_vxid == rec_vxid[a])
#endif
#define pid_in_use(p) ((session_alive[1] && session_pid[1] == p) \
                        || (session_alive[2] && session_pid[2] == p))
/* an attempt that took the run lock after attempt a has started */
#define successor_started(a) ((started[1] && acquired[1] > acquired[a]) \
                              || (started[2] && acquired[2] > acquired[a]))
#define shared_free (!fence_exclusive && excl_waiting == 0)

/* end a lock session (a terminated backend, a killed worker, a network cut): its lock goes */
#define end_session(a) \
    session_alive[a] = false; \
    if \
    :: run_locked && lock_owner == a -> run_locked = false; lock_owner = 0; lease_expired = false \
    :: else -> skip \
    fi

active proctype LockLoss() {
    byte lost = 0;
    do
#ifdef LEASE
    :: atomic {                  /* nobody renewed it for lease_ttl: it expires, still held */
           (lost < 2 && run_locked && !lease_expired) ->
           lease_expired = true;
           lost++
       }
#else
    :: atomic {
           (lost < 2 && run_locked && session_alive[lock_owner]) ->
           end_session(lock_owner);
           lost++
       }
#endif
    :: break
    od
}

proctype Attempt(byte me) {
    byte n = 0;                  /* fenced transactions begun */
    byte depth = 0;              /* open ones: a Python stack, the innermost ends first */
    bool own[NTX + 1];           /* [depth] a savepoint in a transaction of the work's own */
    bool armed[NTX + 1];         /* [depth] the commit-time check is armed */
    bool held_at_commit;
    bool ok;

    /* sql: acquire_run_lock or sql: decide (the lock transaction); -DLEASE: sql: lease_acquire
       or sql: decide_lease (the lease taken in a transaction of its own, committed at once) */
    atomic {
        if
        :: completed -> goto refused   /* the decision's read: a completed key, its no-op */
#ifdef LEASE
        :: !completed && (!run_locked || lease_expired) ->
            if                   /* a take-over: the expired holder's lease is gone */
            :: run_locked -> session_alive[lock_owner] = false
            :: else -> skip
            fi;
            lease_expired = false;
#else
        :: !completed && !run_locked ->
#endif
            run_locked = true;
            lock_owner = me;
            if                       /* a pid no live session has: the OS reuses them */
            :: !pid_in_use(1) -> lock_pid = 1
            :: !pid_in_use(2) -> lock_pid = 2
            fi;
            session_pid[me] = lock_pid;
            acquisitions++;
            acquired[me] = acquisitions;
            lock_vxid = next_vxid;
            next_vxid++;
            session_alive[me] = true;
            rec_pid[me] = lock_pid;
            rec_vxid[me] = lock_vxid
        :: else -> goto refused                                 /* RunLockedError */
        fi
    }

    /* sql: start_attempt, whose first statement is sql: fence_take_over */
    atomic {
        if
        :: fence_shared == 0 && shared_free -> fence_exclusive = true; ok = true
        :: else -> excl_waiting++; takeover_waits[me] = true; ok = false
        fi
    }
    if
    :: !ok ->
        do
        :: atomic {
               (fence_shared == 0 && !fence_exclusive) ->
               excl_waiting--; takeover_waits[me] = false; fence_exclusive = true; break
           }
#ifndef UNBOUNDED_TAKEOVER
        :: atomic {                                              /* IF002: LockWaitError */
               excl_waiting--; takeover_waits[me] = false; goto failed
           }
#endif
        od
    :: else -> skip
    fi;
#ifndef START_UNCHECKED
    atomic {                     /* run_lock_held_by under the exclusive fence key (0012): IF001 */
        if
        :: !held_by(me) -> fence_exclusive = false; goto failed
        :: else -> skip
        fi
    }
#endif
    atomic {                                                     /* the start commits */
        assert(!successor_started(me));  /* no start after a later lock holder's start */
        fence_exclusive = false;
#ifndef START_TAKES_COMPLETED
        if                       /* sql: start_attempt reads the run again, after the wait: */
        :: completed -> goto failed      /* completed since the decision: a no-op, nothing */
        :: else -> skip                  /* open; the lock released as a failure's is */
        fi;
#endif
        started[me] = true
    }

    /* the work: fenced transactions, each may begin inside the open ones */
    do
    :: n < NTX ->
        n++;
        depth++;
        if
        :: own[depth] = false     /* run.transaction(), or the ledger's claim on its own connection */
        :: own[depth] = true      /* run.transaction() inside run.connection.transaction() */
        fi;
        /* sql: fence_enter */
#ifdef DEFECT1
        enter_waits[me] = true;
        atomic { shared_free -> enter_waits[me] = false; fence_shared++; open_shared[me]++ }
#else
        atomic {
            if
            :: shared_free -> fence_shared++; open_shared[me]++; ok = true
            :: else -> ok = false
            fi
        }
        if
        :: !ok ->
            atomic {
                if
                :: held_by(me) -> enter_waits[me] = true       /* wait, bounded */
                :: else -> depth--; goto failed                 /* IF001 at once */
                fi
            }
            do
            :: atomic {
                   shared_free ->
                   enter_waits[me] = false; fence_shared++; open_shared[me]++; break
               }
            :: atomic { enter_waits[me] = false; depth--; goto failed }   /* IF002 */
            od
        :: else -> skip
        fi;
#endif
        atomic {
            if
            :: held_by(me) -> skip
            :: else -> goto failed                              /* IF001 */
            fi
        }
#ifdef DEFECT2
        armed[depth] = !own[depth];
#else
        armed[depth] = true;                                    /* fence_enter arms it */
#endif
        ok = false;
    :: depth > 0 ->
        /* sql: fence_arm, sent with the COMMIT (with that of the work's own transaction) */
#ifdef DEFECT2
        armed[depth] = armed[depth] || !own[depth];
#else
        armed[depth] = true;
#endif
        atomic {              /* COMMIT: the deferred trigger fence_check_at_commit runs */
            held_at_commit = held_by(me);
            if
            :: armed[depth] && !held_at_commit -> goto failed    /* IF001: LockLostError */
            :: else -> skip
            fi
        }
        atomic {              /* the commit lands, and its fence lock goes */
            assert(held_at_commit);
            assert(!successor_started(me));
            fence_shared--;
            open_shared[me]--;
            held_at_commit = false;      /* dead values reset: fewer states */
            armed[depth] = false;
            own[depth] = false;
            depth--
        }
    :: depth > 0 ->           /* the work raises: the innermost transaction rolls back */
        atomic {
            fence_shared--; open_shared[me]--; armed[depth] = false; own[depth] = false; depth--
        }
#ifdef LEASE
#ifdef LEASE_RENEW_UNCHECKED
    :: atomic {                  /* a renewal by key alone: it takes the lease back */
           run_locked && (lease_expired || !held_by(me)) ->
           lease_expired = false; lock_owner = me; lock_vxid = rec_vxid[me]
       }
#else
    :: atomic { lease_expired && held_by(me) -> lease_expired = false }   /* sql: lease_renew */
#endif
#endif
    :: depth == 0 -> break
    od;

#ifdef LEASE
    /* sql: complete_attempt_lease, a fenced transaction of its own: its enter (the fence key
       is not free only while a successor's takeover holds or awaits it, i.e. the lease changed
       hands: IF001 at once) and its check at COMMIT */
    atomic {
        if
        :: shared_free && held_by(me) -> fence_shared++; open_shared[me]++
        :: else -> goto failed
        fi
    }
    atomic {                  /* COMMIT: the deferred trigger fence_check_at_commit runs */
        held_at_commit = held_by(me);
        if
#ifndef LEASE_COMPLETION_UNFENCED
        :: !held_at_commit -> goto failed                        /* IF001: LockLostError */
#endif
        :: else -> skip
        fi
    }
    atomic {                  /* the completion lands, and its fence lock goes; sql:
                                 lease_release_at_commit: the lease is released at that COMMIT,
                                 after the check (a later deferred trigger), if it is still
                                 this token's, expired or not (a successor's is left) */
        assert(held_at_commit);
        assert(!successor_started(me));
        assert(!completed);      /* the key's work completes once */
        completed = true;
        fence_shared--;
        open_shared[me]--;
        held_at_commit = false;
        if
        :: held_by(me) && session_alive[me] -> end_session(me)
        :: else -> skip
        fi
    }
#else
    /* sql: complete_attempt, in the lock transaction; its COMMIT releases the lock */
    atomic {
        if
        :: held_by(me) && session_alive[me] ->
            assert(!completed);  /* the key's work completes once */
            completed = true;
            end_session(me)
        :: else -> goto failed
        fi
    }
#endif
    goto done;

failed:                       /* every open transaction rolls back; the failure is recorded
                                 (-DLEASE: then sql: lease_release) */
    atomic {
        fence_shared = fence_shared - open_shared[me];
        open_shared[me] = 0;
        depth = 0;
        armed[1] = false; armed[2] = false; armed[3] = false;
        own[1] = false; own[2] = false; own[3] = false;
        ok = false;
        if
        :: session_alive[me] -> end_session(me)
        :: else -> skip
        fi
    }
refused:
done:
    skip
}

#ifndef NO_CYCLE_MONITOR
/* A fenced enter queued behind the takeover of the attempt that holds the run lock now (a
   successor), which waits for a transaction of the enter's own attempt: that transaction ends
   only when the enter returns (an edge in the worker's Python, unseen by PostgreSQL). */
active proctype WaitCycle() {
    assert(!((enter_waits[1] && takeover_waits[2] && held_by(2) && open_shared[1] > 0)
             || (enter_waits[2] && takeover_waits[1] && held_by(1) && open_shared[2] > 0)))
}
#endif

init {
    atomic { run Attempt(1); run Attempt(2) }
}
