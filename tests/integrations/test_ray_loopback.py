"""The local Ray cluster of ``launcher=ray`` listens on the loopback interface only.

Started as the launcher starts it (:func:`rlalign.integrations.ray.launcher.connect`, ``ray.address`` unset),
with an actor placed as the trainer is, every TCP listener of the driver and of the processes Ray started
(GCS, raylet, core workers, runtime-env agent, autoscaler monitor) is on 127.0.0.1 (``ss -ltnp``). Skipped
where ``ss`` is missing.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import types

import pytest

ray = pytest.importorskip("ray")   # a test extra
psutil = pytest.importorskip("psutil")

from rlalign.integrations.ray import launcher  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")

SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # what the launcher sets while the cluster starts


def is_loopback(local: str) -> bool:
    """``ss``'s local address (``127.0.0.1:5``, ``[::ffff:127.0.0.1]:5``, ``*:5``, ``[::]:5``) is a loopback one."""
    host = local.rpartition(":")[0].strip("[]")
    if host in ("*", ""):
        return False
    ip = ipaddress.ip_address(host.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process name) of every TCP listener owned by ``pids`` (``ss -ltnpH``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            name = re.findall(r'\("([^"]+)"', line)
            rows.append((line.split()[3], name[0] if name else "?"))
    return rows


def test_is_loopback_reads_ss_addresses():
    assert is_loopback("127.0.0.1:44217") and is_loopback("[::ffff:127.0.0.1]:39501") and is_loopback("[::1]:9")
    assert not any(map(is_loopback, ["*:40499", "0.0.0.0:44217", "[::]:8", "192.0.2.2:41969"]))


@pytest.fixture
def local_cluster(monkeypatch):
    # a throw-away cluster needs no auth token file, and no memory monitor killing workers on a shared machine;
    # set for this test only (the listeners Ray opens do not depend on either)
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", os.environ.get("RAY_memory_monitor_refresh_ms", "0"))
    if ray.is_initialized():   # a cluster another test left: the launcher must start its own, as a new process would
        ray.shutdown()
    section = types.SimpleNamespace(address=None, cpus_per_actor=1, num_rollout_workers=1)
    before = (os.environ.get(SINGLE_NODE_ENV), ray._private.ray_constants.ENABLE_RAY_CLUSTER)
    assert launcher.connect(ray, section)
    try:
        yield before
    finally:
        ray.shutdown()


class _Actor:
    def pid(self) -> int:
        return os.getpid()


def test_local_cluster_listens_on_loopback_only(local_cluster):
    actor = ray.remote(_Actor).options(num_cpus=1).remote()
    assert ray.get(actor.pid.remote()) > 0                  # a worker process with its own gRPC server
    me = psutil.Process()
    rows = listeners({me.pid} | {p.pid for p in me.children(recursive=True)})
    names = {name for _, name in rows}
    assert {"gcs_server", "raylet"} <= names, rows          # the listing saw Ray's servers
    exposed = [(addr, name) for addr, name in rows if not is_loopback(addr)]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert ray.util.get_node_ip_address() == "127.0.0.1"


def test_loopback_settings_do_not_outlive_the_start(local_cluster):
    """The single-node switch is set only while ray.init runs: a later ray.init(address=...) in this process
    (joining a real cluster) sees Ray's own setting."""
    assert (os.environ.get(SINGLE_NODE_ENV), ray._private.ray_constants.ENABLE_RAY_CLUSTER) == local_cluster
