"""`qmill quantize --server a,b,c`: one checkpoint over three `qmill serve` processes, one of them
killed part way; the output is the one-server output byte for byte."""

from __future__ import annotations

from tests.e2e import processes


def test_three_servers_one_killed_give_the_one_server_checkpoint(tmp_path):
    ports = [processes.free_port() for _ in range(3)]
    servers = processes.serve(*ports)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    no_retry = ("--retries", "0")  # no retry: the fan-out alone must cope
    try:
        reference = tmp_path / "one-server.npz"
        one = processes.quantize(reference, addresses[0], *no_retry)
        one_stdout, stderr = one.communicate(timeout=120)
        assert one.returncode == 0, stderr

        out = tmp_path / "three.npz"
        run = processes.quantize(out, ",".join(addresses), *no_retry, delay=0.5)
        processes.wait_for_finished_tensors(out, 2, run)
        processes.kill(servers[1])  # its stream is cut mid-call
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
        assert f"replica {addresses[1]} failed".encode() in stderr, stderr
        assert b"Traceback" not in stderr
        assert out.read_bytes() == reference.read_bytes()
        # The same totals line ("4/6 tensors quantized, … smaller"), the time aside.
        assert stdout.split(b" in ")[0] == one_stdout.split(b" in ")[0]
    finally:
        for server in servers:
            processes.kill(server)
