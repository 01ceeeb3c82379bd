"""`qmill jobs cancel` of a job that has already finished says so (it printed only the job's
line, which read as if it had been cancelled)."""

from __future__ import annotations

from qmill.cli import main as cli
from tests.e2e import processes


def test_cancelling_a_finished_job_says_it_had_finished(server, tmp_path, capsys):
    out = tmp_path / "out.npz"
    submit = ["submit", str(processes.SOURCE), str(out), "--server", server.address, "--watch"]
    assert cli.main(submit) == 0
    job_id = capsys.readouterr().out.split()[0]  # describe(): the id first
    assert out.exists()
    assert cli.main(["jobs", "cancel", job_id, "--server", server.address]) == 0
    err = capsys.readouterr().err
    assert f"job {job_id} had already succeeded: nothing was cancelled" in err
    assert out.exists()  # and nothing was undone
