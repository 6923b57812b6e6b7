"""The job's host admission across real processes (4 ranks over torch.distributed, gloo,
a FileStore): two sharing groups of different shards on one host, their host memory
summed through ``all_gather_object`` over the default group. One byte short is refused
on every rank at once; exactly enough runs bit for bit; a member refused at
create_offloader stops the other group too, without a hang (scenarios in
`tests.sharing.job_workers`)."""

from __future__ import annotations

from pathlib import Path

from tests.sharing.cluster import run_ranks


def test_two_shards_on_one_host_are_summed_refused_one_byte_short_and_run_with_enough(tmp_path: Path) -> None:
    results = [r.result for r in run_ranks(4, "job_admission", tmp_path)]
    assert [r["role"] for r in results] == ["leader", "leader", "follower", "follower"]
    (needed,) = {r["needed"] for r in results}  # every rank computed the same sum
    # Two segments (one per shard) and, the compute device being the CPU, four sets of buffers.
    assert needed == results[0]["segment"] + results[1]["segment"] + sum(r["buffers"] for r in results)
    (refused,) = {r["refused"] for r in results}  # and fails the same way
    assert refused.startswith("refusing to offload on every rank of the job, nothing was moved: ranks 0-3 on host")
    assert "rank 0" in refused and "rank 1" in refused and "writes a shared copy" in refused
    for r in results:
        assert r["ranks"] == [0, 1, 2, 3]
        assert r["untouched"] and r["seconds"] < 2.0  # before anything moved, without waiting for anyone
        assert all(r["equal"])


def test_a_member_refused_at_create_stops_every_process_of_the_job(tmp_path: Path) -> None:
    results = [r.result for r in run_ranks(4, "job_failure", tmp_path)]
    for rank in (1, 3):
        assert "the offloaded weights of rank 3 differ from rank 1's" in results[rank]["error"]
    for rank in (0, 2):
        assert results[rank]["error"].startswith("rank 1 failed creating its offloader (ExecutionError: refusing")
    assert all(r["seconds"] < 10 for r in results)  # told in the exchange, not timed out
