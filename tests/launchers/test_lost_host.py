"""A lost host: its link is cut (no connection is reset, packets just stop), and the ranks on the
other host notice it within the keep-alive bound, shrink, and go on without it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import distcomm

from ._cluster import SUBNET, _ip, hosts, python_env

pytestmark = pytest.mark.launchers

JOB = textwrap.dedent("""
    import json, time
    import distcomm

    comm = distcomm.from_env(timeout=300)
    step = 0
    try:
        while True:
            comm.all_gather(step)
            step += 1
            if step == 20:
                print(json.dumps({"ready": comm.rank}), flush=True)
            time.sleep(0.02)
    except distcomm.DistCommError as e:
        failed_at, error = time.time(), str(e)
    new = comm.shrink()
    print(json.dumps({"noticed": failed_at, "shrunk": time.time(), "error": error[:300],
                      "members": new.membership.job_ranks, "lost": new.membership.lost,
                      "gathered": new.all_gather(new.rank)}), flush=True)
    new.close()
""")


def _in(ns: str, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    wrapped = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$@"', "sh", *cmd]
    return subprocess.Popen(wrapped, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@contextlib.contextmanager
def _ended_on_exit(procs: list[subprocess.Popen[str]]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait(10)


def test_a_host_whose_link_is_cut_is_lost_within_the_keep_alive_bound(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    port = str(distcomm.free_port())
    with hosts(2) as nodes:
        common = {"MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": port, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "DISTCOMM_STORE": "external", "GLOO_SOCKET_IFNAME": "eth0"}
        procs = [_in(nodes[0], [sys.executable, "-m", "distcomm", "store", "--port", port], python_env(), tmp_path)]
        with _ended_on_exit(procs):
            time.sleep(2.0)  # the store listens
            for r in range(4):
                env = python_env({**common, "RANK": str(r), "LOCAL_RANK": str(r % 2)})
                procs.append(_in(nodes[r // 2], [sys.executable, "job.py"], env, tmp_path))
            for p in procs[1:]:
                assert p.stdout is not None
                line = p.stdout.readline()
                assert line.startswith('{"ready"'), (line, p.stderr.read() if p.poll() is not None else "")
            cut = time.time()
            _ip("link", "set", f"{nodes[1]}h", "down")  # the second host's cable: no reset, nothing
            said = []
            try:
                for p in procs[1:3]:
                    out, err = p.communicate(timeout=240)
                    assert p.returncode == 0, err[-3000:]
                    said.append(json.loads(out.strip().splitlines()[-1]))
            finally:
                _ip("link", "set", f"{nodes[1]}h", "up")  # its connections then close as the test ends
    for s in said:
        assert s["members"] == [0, 1] and s["lost"] == [2, 3] and s["gathered"] == [0, 1], s
        assert "has not answered for 30 s" in s["error"] or "lost a peer" in s["error"], s
        assert s["noticed"] - cut < 60, s  # the keep-alive bound and a slice, far below the 300 s timeout
    print(f"lost host: noticed after {max(s['noticed'] for s in said) - cut:.1f} s, "
          f"shrunk after {max(s['shrunk'] for s in said) - cut:.1f} s")
