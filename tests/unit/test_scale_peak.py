"""The scale benchmark's peak of server connections (bench/scale.py): a backend the pooler had
already closed, still exiting when pg_stat_activity was sampled, is not counted; one it closed
after the sample is.

The log lines are PgBouncer 1.18's, as the N=500 cell of issue 32 logged them: the server
connection of local port 43438 closed at 15.439 ("client disconnect while server was not
ready") and its replacement opened 16 ms later; the sample at 15.468 listed both backends."""

from __future__ import annotations

import datetime as dt

from bench.scale import _Sampler, pooler_closes

LOG = """\
2026-12-07 00:35:38.527 UTC [10720] LOG S-0x561b39649090: db/postgres@127.0.0.1:37631 new connection to server (from 127.0.0.1:43438)
2026-12-07 00:35:38.600 UTC [10720] LOG C-0x561b3964a000: db/postgres@127.0.0.1:50000 login attempt: db=db user=postgres tls=no
2026-12-07 00:36:15.439 UTC [10720] LOG S-0x561b39649090: db/postgres@127.0.0.1:37631 closing because: client disconnect while server was not ready (age=36s)
2026-12-07 00:36:15.455 UTC [10720] LOG S-0x561b39649090: db/postgres@127.0.0.1:37631 new connection to server (from 127.0.0.1:34296)
2026-12-07 00:36:16.584 UTC [10720] LOG S-0x561b39649090: db/postgres@127.0.0.1:37631 closing because: client disconnect while server was not ready (age=1s)
"""


def at(clock: str) -> float:
    return dt.datetime.strptime(f"2026-12-07 {clock}", "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_the_pooler_log_says_which_port_it_closed_when() -> None:
    assert pooler_closes(LOG) == {43438: [at("00:36:15.439")], 34296: [at("00:36:16.584")]}


def test_a_backend_the_pooler_closed_before_the_sample_is_not_counted() -> None:
    sampler = _Sampler.__new__(_Sampler)  # its samples only: no database
    sampler.peak = sampler.raw_peak = 0
    others = {pid: (40000 + pid, at("00:35:38.000"), f"{pid} other") for pid in range(19)}
    sampler.samples = [
        # 19 others, the closed one (still exiting) and its replacement: 21 listed
        (
            at("00:36:15.468"),
            {
                **others,
                11333: (43438, at("00:35:38.528"), "11333 43438 closed"),
                13555: (34296, at("00:36:15.457"), "13555 34296 replacement"),
            },
        ),
        # the replacement closed after this sample: still counted, 20
        (at("00:36:16.500"), {**others, 13555: (34296, at("00:36:15.457"), "13555")}),
    ]
    sampler.settle(pooler_closes(LOG))
    assert (sampler.peak, sampler.raw_peak) == (20, 21)
    assert sampler.exiting == ["11333 43438 closed"]
    assert len(sampler.at_peak) == 21
    sampler.peak = sampler.raw_peak = 0
    sampler.settle({})  # no pooler (the direct path): every listed backend counts
    assert (sampler.peak, sampler.raw_peak) == (21, 21)
