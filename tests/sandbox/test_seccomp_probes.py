"""One probe per entry of the seccomp deny-list and per socket family.

``deny_probe.py`` tries each entry harmlessly inside a real tool call (T2 and
T1, through the broker and worker). A control run of the same probe in a T2
chain *without* the filter shows which refusals only the filter can explain
(the unfiltered call fails otherwise, or works); the entries a capability
check refuses first either way are checked in the compiled filter's pseudo
code instead.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import platform
import re
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from broker.client import BrokerClient
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS
from sandbox_worker.sandbox.process import RunSpec, run
from sandbox_worker.sandbox.profile import Profile
from sandbox_worker.sandbox.seccomp import (
    AF_NETLINK,
    DENIED_SYSCALLS,
    NET_FAMILIES,
    make_filter,
)
from sandbox_worker.sandbox.user import ensure_user
from tests.sandbox.conftest import Stack, needs_system_python, shell

pytestmark = [pytest.mark.sandbox,
              pytest.mark.skipif(platform.machine() != "x86_64",
                                 reason="the probe uses x86-64 syscall numbers")]

PROBE = (Path(__file__).with_name("deny_probe.py")).read_text()
# The list (and SANDBOX.md's): each must be shown refused *by the filter*.
# (fsopen, fsmount, fspick and move_mount check CAP_SYS_ADMIN before their
# arguments, as do kexec_*, *_module, acct, swap*, reboot, pivot_root and
# open_by_handle_at: EPERM either way; the pseudo-code test covers them.)
MUST_BE_FILTER_REFUSALS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "unshare", "setns", "mount", "umount2", "open_tree", "fsconfig",
    "mount_setattr", "clone3",
    "clone(NEWNS)", "clone(NEWUSER)", "clone(NEWPID)", "clone(NEWNET)", "clone(NEWIPC)",
    "clone(NEWUTS)", "clone(NEWCGROUP)", "ioctl(TIOCSTI)", "ioctl(TIOCLINUX)")


def refused_as(name: str) -> int:
    return errno.ENOSYS if name == "clone3" else errno.EPERM


def run_probe_without_filter() -> dict[str, int]:
    """The probe at the end of a T2 chain with no seccomp filter (the control)."""
    async def go() -> dict[str, int]:
        user = await ensure_user()
        ws = tempfile.mkdtemp(prefix="corral-deny-", dir="/var/tmp")
        os.chown(ws, user.uid, user.gid)
        try:
            chain = Profile("T2", user, None, None).build(
                ["/usr/bin/python3", "-I", "-S", "-c", PROBE], ws, DEFAULT_LIMITS,
                network=False, uid=user.uid)
            assert "--seccomp" not in chain.argv
            out = await run(RunSpec(chain.argv, chain.env, 30.0, 1 << 20, chain.pass_fds))
        finally:
            shutil.rmtree(ws, ignore_errors=True)
        assert out.exit_code == 0, out.stderr
        return dict(json.loads(out.stdout))

    return asyncio.run(go())


async def test_every_deny_list_entry_is_refused(stack: Stack, client: BrokerClient,
                                                workspace: Path) -> None:
    needs_system_python()
    res = await shell(client, ["/usr/bin/python3", "-I", "-S", "-c", PROBE], workspace)
    assert res.result["outcome"] == "ok", res.result["output"]
    seen: dict[str, int] = json.loads(res.result["output"].splitlines()[0])
    # Every entry the probe tries (its own list, not the filter's) is refused.
    entries = [k for k in seen if not k.startswith(("socket(", "netlink("))]
    assert len(entries) >= 45
    wrong = {n: errno.errorcode.get(seen[n], seen[n]) for n in entries
             if seen[n] != refused_as(n)}
    assert wrong == {}
    allowed = NET_FAMILIES if stack.tier == "T2" else (socket.AF_UNIX,)
    for family in [*range(64), 64, 200]:
        if family not in allowed:
            assert seen[f"socket({family})"] == errno.EAFNOSUPPORT, family
    assert seen[f"socket({socket.AF_UNIX})"] == 0
    assert seen["socket(40)"] == errno.EAFNOSUPPORT  # AF_VSOCK: the hypervisor
    for proto in (4, 9, 15, 12):
        assert seen[f"netlink({proto})"] == errno.EAFNOSUPPORT, proto
    if stack.tier == "T2":
        assert seen["netlink(0)"] == 0  # NETLINK_ROUTE: getaddrinfo, if_nameindex, ip
        assert seen[f"socket({socket.AF_INET})"] == 0  # loopback in its own namespace


def test_the_refusals_are_the_filters() -> None:
    needs_system_python()
    unfiltered = run_probe_without_filter()
    # Without the filter none of these is EPERM (ENOSYS for clone3): so the
    # refusal seen inside the sandbox is the filter's, not a missing capability.
    same = {n: errno.errorcode.get(unfiltered[n], unfiltered[n])
            for n in MUST_BE_FILTER_REFUSALS if unfiltered[n] == refused_as(n)}
    assert same == {}
    assert unfiltered["socket(40)"] != errno.EAFNOSUPPORT  # vsock exists on this host
    assert unfiltered[f"netlink({9})"] != errno.EAFNOSUPPORT


def test_capability_gated_entries_are_in_the_filter(tmp_path: Path) -> None:
    flt, missing = make_filter(NET_FAMILIES)
    pfc = tmp_path / "filter.pfc"
    with pfc.open("w") as f:
        flt.export_pfc(f)
    text = pfc.read_text()
    for name in DENIED_SYSCALLS:
        if name in missing:
            continue
        block = re.search(rf'# filter for syscall "{name}" \(\d+\)[^\n]*\n(.*?)(?=\n\s*#|\Z)',
                          text, re.S)
        assert block is not None, name
        assert f"action ERRNO({errno.EPERM});" in block.group(1), (name, block.group(1))
    socket_rules = re.search(r'# filter for syscall "socket".*?(?=\n\s*# filter|\n\s*# default)',
                             text, re.S)
    assert socket_rules is not None
    assert f"$a0.lo32 == {AF_NETLINK}" in socket_rules.group(0)
    assert "$a0.lo32 == 40" in socket_rules.group(0)
