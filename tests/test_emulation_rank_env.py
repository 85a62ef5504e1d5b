"""The environment the launcher gives each rank of an emulated multi-DC run on one host.

On a GPU box NCCL would take ranks of two emulated DCs (network namespaces of one machine) for one host
and join them by P2P/SHM, skipping the emulated WAN; each DC must be its own NCCL host that talks over
its namespace's veth, while a user's own NCCL_* settings win. The ranks here only dump their
environment (no torch, no namespaces: the WAN launch's popen runs them directly), so this runs anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys

from geotrain.emulation import WanEmulation
from geotrain.emulation.netns import DC_IFNAME
from geotrain.runtime.cross_dc import WanLaunch
from geotrain.runtime.launch import launch_ranks
from geotrain.spec import Cluster

DUMP = ("import json, os, sys; "
        "open(sys.argv[1] + '/env' + os.environ['RANK'] + '.json', 'w').write(json.dumps(dict(os.environ)))")


class _DirectLaunch(WanLaunch):
    """The kernel-mode WAN launch minus `ip netns exec` (that needs root and a started emulation)."""

    def popen(self, rank, argv, env, **kw):
        return subprocess.Popen(list(argv), env=env, **kw)


def _cluster() -> Cluster:
    return Cluster.model_validate({
        "name": "env-test",
        "datacenters": [{"name": "east", "gpu_type": "cpu", "gpus": 2}, {"name": "west", "gpu_type": "cpu", "gpus": 2}],
        "wan_links": [{"between": ["east", "west"], "latency_ms": 5, "capacity_gbps": 1, "per_connection_gbps": 1}],
    })


def _rank_envs(tmp_path, wan) -> list[dict[str, str]]:
    launch_ranks([sys.executable, "-c", DUMP, str(tmp_path)], 4, tmp_path / "logs", wan=wan, rank0_stdout=False,
                 timeout_s=60)
    return [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]


def test_each_emulated_dc_is_its_own_nccl_host_over_its_veth(tmp_path, monkeypatch):
    for var in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    emu = WanEmulation(_cluster(), tag="e0e0e0")          # never started: only its names are used
    envs = _rank_envs(tmp_path, _DirectLaunch("kernel", ["east", "east", "west", "west"], emulation=emu))
    ids = [e.get("NCCL_HOSTID") for e in envs]
    assert None not in ids
    assert ids[0] == ids[1] and ids[2] == ids[3], "ranks of one DC must stay one host (P2P/SHM)"
    assert ids[0] != ids[2], "ranks of two DCs must be two hosts (NET over the emulated link)"
    for e in envs:
        assert e["NCCL_SOCKET_IFNAME"] == f"={DC_IFNAME}" == f"={e['GLOO_SOCKET_IFNAME']}"
        assert e["NCCL_IB_DISABLE"] == "1"
        assert e["MASTER_ADDR"] == emu.address("east")


def test_nccl_settings_the_user_made_are_kept_and_a_plain_launch_sets_none(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=mine0")
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    emu = WanEmulation(_cluster(), tag="e1e1e1")
    envs = _rank_envs(tmp_path / "wan", _DirectLaunch("kernel", ["east", "east", "west", "west"], emulation=emu))
    assert [e["NCCL_SOCKET_IFNAME"] for e in envs] == ["=mine0"] * 4
    assert len({e["NCCL_HOSTID"] for e in envs}) == 2
    # No emulation (one DC, or a real cluster's torchrun): the launcher adds no NCCL identity.
    plain = _rank_envs(tmp_path / "plain", None)
    assert all("NCCL_HOSTID" not in e for e in plain)


def test_rehearse_hosts_get_the_same_identity_as_launched_ranks():
    """`rehearse` starts one torchrun per DC with `host_env`: the DC's own NCCL host, over its veth."""
    emu = WanEmulation(_cluster(), tag="e2e2e2")
    east, west = emu.host_env("east", {}), emu.host_env("west", {})
    assert east["NCCL_HOSTID"] != west["NCCL_HOSTID"]
    assert east == {k: v for k, v in emu.rank_env("east", "east", 1, {}).items() if k in east}
    assert east["GLOO_SOCKET_IFNAME"] == DC_IFNAME and east["NCCL_SOCKET_IFNAME"] == f"={DC_IFNAME}"
    assert "NCCL_HOSTID" not in emu.host_env("east", {"NCCL_HOSTID": "mine"})
