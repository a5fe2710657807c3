"""Isolation records come from what the kernel shows, never from configuration.

Each layer of a tier is dropped from the real argv chain on purpose (the
builder is wrapped to omit it, the way a bug in it would) and the probe of
that chain, tier detection, or the call itself must notice. A real tool
call's own ``/proc/self/status`` and ``/proc/self/ns`` are compared with its
record.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClient
from sandbox_worker.api import Tier
from sandbox_worker.sandbox.cgroup import WorkerCgroup
from sandbox_worker.sandbox.detect import detect
from sandbox_worker.sandbox.errors import ToolError
from sandbox_worker.sandbox.limits import DEFAULT_LIMITS, merge_limits
from sandbox_worker.sandbox.profile import Chain, Profile
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser
from sandbox_worker.sandbox.verify import NAMESPACES
from sandbox_worker.tools.shell import run_shell
from tests.helpers import Procs
from tests.sandbox.conftest import HB_S, Stack, shell, start_stack

pytestmark = pytest.mark.sandbox

Edit = Callable[[list[str]], list[str]]


@pytest.fixture
def scratch(user: SandboxUser) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="corral-rec-", dir="/var/tmp")
    os.chown(path, user.uid, user.gid)
    os.chmod(path, 0o755)  # a chain left as root without capabilities can enter it too
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def drop(prefix: str, values: int = 0) -> Edit:
    """Omit the token ``prefix`` (or ``prefix...`` when it ends with ``=``) and
    the ``values`` after it; chains without it are left alone."""
    def edit(tokens: list[str]) -> list[str]:
        for at, token in enumerate(tokens):
            if token == prefix or (prefix.endswith("=") and token.startswith(prefix)):
                return tokens[:at] + tokens[at + 1 + values:]
        return tokens
    return edit


def unshare_all_but(ns: str) -> Edit:
    """``--unshare-all`` spelled out, without one namespace (net: a grant)."""
    flags = {"ipc": "--unshare-ipc", "pid": "--unshare-pid", "uts": "--unshare-uts",
             "cgroup": "--unshare-cgroup", "net": "--unshare-net"}

    def edit(tokens: list[str]) -> list[str]:
        at = tokens.index("--unshare-all")
        keep = [f for n, f in flags.items() if n != ns]
        return tokens[:at] + keep + tokens[at + 1:]
    return edit


def break_builder(monkeypatch: pytest.MonkeyPatch, edit: Edit) -> None:
    """Make ``Profile.build`` omit a layer. The edit is applied to the argv
    and to its shape alike (the shape is the argv token by token, per-call
    values masked), as if the builder itself had the bug."""
    real = Profile.build

    def build(self: Profile, command: list[str], *args: Any, **kw: Any) -> Chain:
        chain = real(self, command, *args, **kw)
        head, tail = chain.argv[:len(chain.argv) - len(command)], list(command)
        chain.argv = [*edit(head), *tail]
        chain.shape = tuple(edit(list(chain.shape)))
        return chain

    monkeypatch.setattr(Profile, "build", build)


def probe(tier: Tier, user: SandboxUser, filters: SeccompFilters, scratch: str,
          ) -> list[str]:
    profile = Profile(tier, user, filters, None)
    _, verified = asyncio.run(profile.verify_chain(scratch, network=False, uid=user.uid,
                                                   tmpdir=scratch))
    assert verified.view is not None or verified.problems
    return verified.problems


LAYERS: list[tuple[Tier, str, Edit, str]] = [
    ("T2", "seccomp", drop("--seccomp", 1), "seccomp filter not in force"),
    ("T1", "seccomp", drop("--seccomp-fd", 1), "seccomp filter not in force"),
    # bwrap left as root without capabilities cannot even map its uid: the
    # probe fails, so the chain is refused all the same.
    ("T2", "uid drop", drop("--reuid="), "probe failed: bwrap: setting up uid map"),
    ("T1", "uid drop", drop("--reuid="), "uid drop not in force"),
    ("T0", "uid drop", drop("--reuid="), "uid drop not in force"),
    ("T2", "gid drop", drop("--regid="), "gid drop not in force"),
    ("T0", "no_new_privs", drop("--no-new-privs"), "no_new_privs not set"),
    ("T2", "RLIMIT_NPROC", drop("--nproc="), "RLIMIT_NPROC not applied"),
    ("T1", "RLIMIT_AS", drop("--as="), "RLIMIT_AS not applied"),
    ("T0", "RLIMIT_CPU", drop("--cpu="), "RLIMIT_CPU not applied"),
    ("T2", "RLIMIT_NOFILE", drop("--nofile="), "RLIMIT_NOFILE not applied"),
    ("T2", "RLIMIT_FSIZE", drop("--fsize="), "RLIMIT_FSIZE not applied"),
    ("T2", "pid namespace", unshare_all_but("pid"), "shared with the worker: pid"),
    ("T2", "ipc namespace", unshare_all_but("ipc"), "shared with the worker: ipc"),
    ("T2", "uts namespace", unshare_all_but("uts"), "shared with the worker: uts"),
    ("T2", "cgroup namespace", unshare_all_but("cgroup"), "shared with the worker: cgroup"),
    ("T2", "net namespace", unshare_all_but("net"), "shared with the worker: net"),
    # No /proc inside at T2-: the namespaces are read from the host side.
    ("T2-", "pid namespace", unshare_all_but("pid"), "shared with the worker: pid"),
    ("T2-", "net namespace", unshare_all_but("net"), "shared with the worker: net"),
    ("T2-", "seccomp", drop("--seccomp", 1), "seccomp filter not in force"),
    ("T1", "landlock", drop("--landlock"), "host directory outside the workspace is writable"),
]


@pytest.mark.parametrize(("tier", "layer", "edit", "expected"), LAYERS,
                         ids=[f"{t}-{name}" for t, name, _, _ in LAYERS])
def test_probe_notices_a_dropped_layer(monkeypatch: pytest.MonkeyPatch, user: SandboxUser,
                                       filters: SeccompFilters, scratch: str, tier: Tier,
                                       layer: str, edit: Edit, expected: str) -> None:
    assert probe(tier, user, filters, scratch) == []  # the intact chain holds
    break_builder(monkeypatch, edit)
    problems = probe(tier, user, filters, scratch)
    assert any(expected in p for p in problems), (layer, problems)


@pytest.mark.parametrize("tier", ["T2", "T1"])
def test_probe_notices_a_chain_that_skips_the_worker_cgroup(
        monkeypatch: pytest.MonkeyPatch, user: SandboxUser, filters: SeccompFilters,
        scratch: str, tier: Tier) -> None:
    cgroup = WorkerCgroup(1 << 30, 512)
    cgroup.setup()
    try:
        if not cgroup.applied:
            pytest.skip(f"no worker cgroup here: {cgroup.reason}")

        def problems() -> list[str]:
            _, verified = asyncio.run(Profile(tier, user, filters, cgroup).verify_chain(
                scratch, network=False, uid=user.uid, tmpdir=scratch))
            return verified.problems

        assert problems() == []
        break_builder(monkeypatch, lambda tokens: tokens[tokens.index("setpriv"):])
        assert any("worker cgroup not joined" in p for p in problems())
    finally:
        cgroup.close()


def test_detection_drops_a_tier_whose_seccomp_is_gone(monkeypatch: pytest.MonkeyPatch,
                                                      user: SandboxUser,
                                                      filters: SeccompFilters) -> None:
    break_builder(monkeypatch, drop("--seccomp", 1))
    result = asyncio.run(detect(Profile("T2", user, filters, None), user.uid))
    assert "T2" not in result.working
    assert "seccomp filter not in force" in result.failures["T2"]
    assert "T1" in result.working  # its launcher loads the filter itself


def test_a_call_whose_chain_lost_a_layer_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                    user: SandboxUser,
                                                    filters: SeccompFilters,
                                                    scratch: str) -> None:
    profile = Profile("T2", user, filters, None)
    detection = asyncio.run(detect(profile, user.uid))
    profile.verified.update(detection.verified["T2"])
    marker = f"corral-ran-{os.getpid()}"
    args = {"command": f"touch {marker}"}

    async def call() -> Any:
        return await run_shell(profile, args, scratch, DEFAULT_LIMITS, network=False,
                               uid=user.uid, call_id="rec-refused", remaining_s=30.0,
                               on_chunk=None, grace_s=0.5)

    ok = asyncio.run(call())
    assert ok.outcome.exit_code == 0
    record = profile.isolation(DEFAULT_LIMITS, network=False, uid=user.uid, shape=ok.shape)
    assert record["seccomp"] is True
    os.unlink(Path(scratch) / marker)
    # After detection, the builder loses the seccomp filter: the call's chain
    # has a shape never probed, its probe shows the filter missing, and the
    # command never runs.
    break_builder(monkeypatch, drop("--seccomp", 1))
    with pytest.raises(ToolError, match="seccomp filter not in force") as info:
        asyncio.run(call())
    assert info.value.kind == "sandbox_unavailable"
    assert not (Path(scratch) / marker).exists()
    broken = next(s for s, v in profile.verified.items() if v.problems)
    record = profile.isolation(DEFAULT_LIMITS, network=False, uid=user.uid, shape=broken)
    assert record["seccomp"] is False
    assert record["kernel"] is not None
    assert record["kernel"]["seccomp_mode"] == 0
    assert any("seccomp" in d for d in record["degraded"])


@pytest.mark.parametrize("tier", ["T2", "T1"])
def test_calls_differing_in_per_call_values_share_one_probe(
        user: SandboxUser, filters: SeccompFilters, scratch: str, tier: Tier) -> None:
    """The per-call cost stays a look-up: uid, limits, workdir and call id are
    masked in the shape; a network grant is a new shape, probed once."""
    profile = Profile(tier, user, filters, None)
    profile.verified.update(asyncio.run(detect(profile, user.uid)).verified[tier])
    os.makedirs(Path(scratch) / "sub")
    os.chmod(Path(scratch) / "sub", 0o777)
    os.chmod(scratch, 0o777)
    other_uid = 4_100_000 + os.getpid() % 100_000  # no process of it exists

    async def call(uid: int, workdir: str, limits: dict[str, int], network: bool) -> int:
        # bound by a pinned fd, as the tool service binds every workspace
        fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            run = await run_shell(profile, {"command": "true", "workdir": workdir}, scratch,
                                  merge_limits(DEFAULT_LIMITS, limits), network=network,
                                  uid=uid, call_id=f"c-{uid}-{workdir}", remaining_s=30.0,
                                  on_chunk=None, grace_s=0.5, workspace_fd=fd)
        finally:
            os.close(fd)
        return run.outcome.exit_code or 0

    assert asyncio.run(call(user.uid, ".", {}, False)) == 0
    assert asyncio.run(call(other_uid, "sub", {"cpu_s": 5, "tmpfs_bytes": 64 << 20},
                            False)) == 0
    assert len(profile.verified) == 1
    assert asyncio.run(call(other_uid, ".", {}, True)) == 0
    assert asyncio.run(call(user.uid, "sub", {"open_files": 64}, True)) == 0
    assert len(profile.verified) == 2


def test_unprobed_chain_is_recorded_as_unverified(user: SandboxUser,
                                                  filters: SeccompFilters) -> None:
    record = Profile("T2", user, filters, None).isolation(
        DEFAULT_LIMITS, network=False, uid=user.uid, shape=("never", "probed"))
    assert record["seccomp"] is False
    assert record["pid_namespace"] is False
    assert record["network"] == "host"
    assert record["kernel"] is None
    assert any("not verified" in d for d in record["degraded"])


# -- end to end: a real call's own view against its record ---------------------

INSIDE = ("grep -E '^(Seccomp|NoNewPrivs|Uid|Gid|CapEff):' /proc/self/status; "
          "for n in " + " ".join(NAMESPACES) + "; do echo \"ns $n $(readlink /proc/self/ns/$n)\"; "
          "done")


def inside_view(output: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    status: dict[str, list[str]] = {}
    ns: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith("ns "):
            _, name, *link = line.split()
            ns[name] = link[0] if link else ""
        elif ":" in line:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return status, ns


def assert_record_matches(iso: dict[str, Any], output: str, worker_pid: int) -> None:
    status, ns = inside_view(output)
    host = {n: os.readlink(f"/proc/{worker_pid}/ns/{n}") for n in NAMESPACES}
    separate = sorted(n for n in NAMESPACES if ns.get(n) and ns[n] != host[n])
    kernel = iso["kernel"]
    assert kernel is not None
    assert kernel["seccomp_mode"] == int(status["Seccomp"][0])
    assert iso["seccomp"] is (status["Seccomp"][0] == "2")
    assert kernel["no_new_privs"] is (status["NoNewPrivs"][0] == "1")
    assert [int(u) for u in status["Uid"]] == [iso["uid"]] * 4 == kernel["uids"]
    assert [int(g) for g in status["Gid"]] == kernel["gids"]
    assert int(status["CapEff"][0], 16) == int(kernel["cap_eff"], 16) == 0
    assert sorted(kernel["namespaces"]) == separate
    assert iso["pid_namespace"] is ("pid" in separate)
    if iso["tier"] == "T2":
        assert (iso["network"] == "none") is ("net" in separate)


async def test_record_matches_what_the_call_saw(stack: Stack, client: BrokerClient,
                                                workspace: Path) -> None:
    res = await shell(client, INSIDE, workspace)
    assert res.result["outcome"] == "ok", res.result["output"]
    iso = res.result["isolation"]
    assert_record_matches(iso, res.result["output"], stack.worker.pid)
    assert iso["seccomp"] is True
    # The READY info says what the tier's probe saw too, not the configuration.
    assert stack.info["seccomp"] is True
    assert stack.info["kernel"]["seccomp_mode"] == 2
    if stack.tier == "T2":
        assert set(iso["kernel"]["namespaces"]) == set(NAMESPACES)
    granted = await shell(client, INSIDE, workspace, {"network": True})
    assert granted.result["outcome"] == "ok", granted.result["output"]
    g_iso = granted.result["isolation"]
    assert_record_matches(g_iso, granted.result["output"], stack.worker.pid)
    assert g_iso["network"] == "granted"
    if stack.tier == "T2":
        assert "net" not in g_iso["kernel"]["namespaces"]


@pytest.mark.parametrize("tier", ["T2-", "T0"])
async def test_forced_tier_record_matches_what_the_call_saw(stack_procs: Procs,
                                                           workspace: Path, tier: str) -> None:
    """T2- (no /proc inside: the namespaces are read from the host) and T0 (no
    namespaces, no seccomp), each through a stack of its own."""
    st = start_stack(stack_procs, tier, *(["--allow-unsandboxed"] if tier == "T0" else []))
    async with BrokerClient(st.frontend, heartbeat_interval_s=HB_S) as client:
        res = await shell(client, INSIDE, workspace)
    iso = res.result["isolation"]
    assert iso["kernel"] is not None
    if tier == "T2-":
        assert "has-proc" not in res.result["output"]  # nothing to read inside
        assert set(iso["kernel"]["namespaces"]) == set(NAMESPACES)
        assert iso["pid_namespace"] is True
        assert iso["seccomp"] is True
        assert iso["kernel"]["cap_eff"] is None  # no /proc/self/status inside
        assert not any("not verified" in d for d in iso["degraded"])
    else:
        assert_record_matches(iso, res.result["output"], st.worker.pid)
        assert iso["seccomp"] is False
        assert iso["kernel"]["namespaces"] == []
        assert iso["network"] == "host"
