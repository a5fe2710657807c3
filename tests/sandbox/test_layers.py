"""The sandbox layers on their own: real bwrap, real processes, real files.

(End-to-end behaviour through the broker is in the test_escape_* and
test_tool_service modules.)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_worker.api import TOOL_NAMES
from sandbox_worker.sandbox.acl import (
    ACL_GROUP,
    XATTR_ACCESS,
    XATTR_DEFAULT,
    decode_acl,
    encode_acl,
)
from sandbox_worker.sandbox.detect import detect
from sandbox_worker.sandbox.errors import BadArguments, TierUnavailable, UnknownTool
from sandbox_worker.sandbox.limits import CEILING_LIMITS, DEFAULT_LIMITS, merge_limits
from sandbox_worker.sandbox.process import RunSpec, run
from sandbox_worker.sandbox.profile import Profile
from sandbox_worker.sandbox.seccomp import SeccompFilters
from sandbox_worker.sandbox.user import SandboxUser
from sandbox_worker.sandbox.workspace import grant_tree
from sandbox_worker.tools.fsops import RESOLVE, openat2
from sandbox_worker.tools.schemas import SCHEMAS, validate
from sandbox_worker.tools.service import ToolService, ToolServiceConfig
from tests.helpers import eventually
from tests.sandbox.conftest import call_processes


def test_sandbox_user_is_not_root(user: SandboxUser) -> None:
    assert user.uid != 0
    assert user.gid != 0


def test_seccomp_fds_start_at_offset_zero(filters: SeccompFilters) -> None:
    for name in ("bwrap", "t1", "t1_net"):
        for _ in range(2):
            fd = filters.open_fd(name)
            try:
                data = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
            assert len(data) == filters.sizes[name]
            assert len(data) % 8 == 0
    assert filters.sizes["t1"] != filters.sizes["t1_net"]  # the socket rules differ


def test_limits_merge_lowers_clamps_and_rejects() -> None:
    merged = merge_limits(DEFAULT_LIMITS, {"cpu_s": 3, "wall_s": 10**9})
    assert merged["cpu_s"] == 3
    assert merged["wall_s"] == CEILING_LIMITS["wall_s"]
    assert merged["output_bytes"] == DEFAULT_LIMITS["output_bytes"]
    for bad in ({"cpu_s": "1"}, {"nope": 1}, {"processes": 1}, {"wall_s": float("nan")},
                {"open_files": True}, "x"):
        with pytest.raises(BadArguments):
            merge_limits(DEFAULT_LIMITS, bad)


def test_schemas_match_validation() -> None:
    assert [s["name"] for s in SCHEMAS] == list(TOOL_NAMES)
    validate("shell", {"command": "ls"})
    validate("shell", {"command": ["ls", "-l"], "workdir": "a", "timeout_s": 1.5})
    validate("list_dir", {})
    validate("edit_file", {"path": "a", "old": "x", "new": "", "count": 2})
    bad = [("shell", {}), ("shell", {"command": 3}), ("shell", {"command": []}),
           ("shell", {"command": "x", "timeout_s": -1}), ("read_file", {"path": "a", "x": 1}),
           ("read_file", {"path": "a", "offset": -1}), ("edit_file", {"path": "a", "old": "",
                                                                      "new": ""}),
           ("write_file", {"path": "a"}), ("read_file", ["a"])]
    for tool, args in bad:
        with pytest.raises(BadArguments) as info:
            validate(tool, args)
        assert tool in str(info.value)
    with pytest.raises(UnknownTool):
        validate("rm_rf", {})


def test_acl_roundtrip() -> None:
    entries = {(1, 0xFFFFFFFF): 7, (2, 999): 6, (4, 0xFFFFFFFF): 5, (16, 0xFFFFFFFF): 7,
               (32, 0xFFFFFFFF): 5}
    assert decode_acl(encode_acl(entries)) == entries


def test_grant_tree_skips_links_and_writes_no_default_acl(workspace: Path, user: SandboxUser,
                                                  tmp_path: Path) -> None:
    outside = Path(tempfile.mkdtemp(prefix="corral-host-", dir="/var/tmp"))
    try:
        (workspace / "sub").mkdir()
        (workspace / "sub" / "f").write_text("x")
        target = outside / "t"
        target.write_text("outside")
        os.link(target, workspace / "hl")
        (workspace / "sl").symlink_to(outside)
        os.chown(workspace, 4242, 4242)  # a user's workspace, not root's
        report = grant_tree(str(workspace), user.gid)
        assert report.skipped_links == 1
        f_acl = decode_acl(os.getxattr(workspace / "sub" / "f", XATTR_ACCESS))
        assert f_acl[(ACL_GROUP, user.gid)] == 6
        # No default ACL: what a call creates has the workspace's group as its
        # owning group, and is the owner's when the call ends (ownership.py).
        with pytest.raises(OSError, match="No data available"):
            os.getxattr(workspace, XATTR_DEFAULT)
        for path in (target, outside):
            with pytest.raises(OSError, match="No data available"):
                os.getxattr(path, XATTR_ACCESS)
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_openat2_refuses_escapes(workspace: Path) -> None:
    (workspace / "link").symlink_to("/etc/passwd")
    (workspace / "f").write_text("ok")
    fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
    try:
        good = openat2(fd, "f", os.O_RDONLY, 0, RESOLVE)
        os.close(good)
        for path in ("../etc/passwd", "/etc/passwd", "link", "f/../../x", "./../x"):
            with pytest.raises(OSError, match=r"cross-device|symbolic links|Not a directory"):
                os.close(openat2(fd, path, os.O_RDONLY, 0, RESOLVE))
    finally:
        os.close(fd)


def test_detection_finds_t2_here(user: SandboxUser, filters: SeccompFilters) -> None:
    result = asyncio.run(detect(Profile("T2", user, filters, None), user.uid))
    assert result.best == "T2", result.failures
    assert "T1" in result.working
    assert result.landlock_abi >= 1


def test_start_refuses_below_tier_min() -> None:
    async def go(cfg: ToolServiceConfig) -> str:
        svc = ToolService(cfg)
        try:
            await svc.start()
        except TierUnavailable as exc:
            return str(exc)
        finally:
            await svc.aclose()
        return ""

    msg = asyncio.run(go(ToolServiceConfig(force_tier="T1", tier_min="T2", cgroup=False)))
    assert "below the minimum T2" in msg
    assert "bubblewrap" in msg
    msg = asyncio.run(go(ToolServiceConfig(force_tier="T0", tier_min="T0", cgroup=False)))
    assert "--allow-unsandboxed" in msg


@pytest.mark.parametrize("tier", ["T2", "T1"])
def test_chain_kills_double_forked_daemon_on_exit(tier: str, user: SandboxUser,
                                                  filters: SeccompFilters, workspace: Path) -> None:
    os.chown(workspace, user.uid, user.gid)
    tag = f"corral-daemon-{os.getpid()}-{tier}"
    profile = Profile(tier, user, filters, None)
    tmp = tempfile.mkdtemp(dir="/var/tmp")
    os.chown(tmp, user.uid, user.gid)
    chain = profile.build(["/bin/bash", "-c", f"(setsid sleep 300 {tag} &) ; echo up"],
                          str(workspace), DEFAULT_LIMITS, network=False, uid=user.uid, tmpdir=tmp)
    try:
        out = asyncio.run(run(RunSpec(chain.argv, chain.env, 30.0, 1 << 20, chain.pass_fds)))
    finally:
        for fd in chain.pass_fds:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.stdout == b"up\n"
    assert out.exit_code == 0
    left = [p for p in psutil.process_iter(["cmdline"]) if tag in " ".join(
        p.info["cmdline"] or [])]
    assert left == []


def test_run_cancel_kills_tree_and_reaps(user: SandboxUser, filters: SeccompFilters,
                                         workspace: Path) -> None:
    os.chown(workspace, user.uid, user.gid)
    profile = Profile("T2", user, filters, None)
    call_id = f"layers-cancel-{os.getpid()}"
    chain = profile.build(["/bin/bash", "-c", "echo go; sleep 600"], str(workspace), DEFAULT_LIMITS,
                          network=False, uid=user.uid, call_id=call_id)
    seen: list[bytes] = []

    async def go() -> None:
        started = asyncio.Event()

        async def on_chunk(stream: str, data: bytes) -> None:
            seen.append(data)
            started.set()

        task = asyncio.create_task(run(RunSpec(chain.argv, chain.env, 60.0, 1 << 20,
                                               chain.pass_fds, grace_s=0.5), on_chunk))
        async with asyncio.timeout(10):
            await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(go())
    finally:
        for fd in chain.pass_fds:
            os.close(fd)
    assert seen == [b"go\n"]
    assert call_processes(user.uid, call_id) == []


def test_orphaned_namespace_inits_are_reaped(user: SandboxUser, filters: SeccompFilters,
                                             workspace: Path) -> None:
    from sandbox_worker.sandbox.reaper import OrphanReaper, _children, _status

    os.chown(workspace, user.uid, user.gid)
    profile = Profile("T2", user, filters, None)

    async def go() -> int:
        reaper = OrphanReaper(range(user.uid, user.uid + 1))
        assert reaper.install()
        try:
            for _ in range(8):
                chain = profile.build(["true"], str(workspace), DEFAULT_LIMITS, network=False,
                                      uid=user.uid)
                try:
                    out = await run(RunSpec(chain.argv, chain.env, 30.0, 1 << 20,
                                            chain.pass_fds))
                finally:
                    for fd in chain.pass_fds:
                        os.close(fd)
                assert out.exit_code == 0
            async def all_reaped() -> bool:
                return reaper.reaped >= 8

            await eventually(all_reaped, timeout_s=10, what="8 orphaned inits reaped")
            return reaper.reaped
        finally:
            reaper.close()

    assert asyncio.run(go()) >= 8
    # No zombie of the sandbox uid is left (children of other uids, e.g. a root
    # helper another test in this xdist worker started, are not the reaper's).
    assert [p for p in _children() if (_status(p) or (False, -1)) == (True, user.uid)] == []


def test_failing_output_sink_ends_the_call(user: SandboxUser, filters: SeccompFilters,
                                           workspace: Path) -> None:
    os.chown(workspace, user.uid, user.gid)
    call_id = f"layers-sink-{os.getpid()}"
    chain = Profile("T2", user, filters, None).build(
        ["/bin/bash", "-c", "echo go; sleep 600"], str(workspace), DEFAULT_LIMITS, network=False,
        uid=user.uid, call_id=call_id)

    async def broken_sink(stream: str, data: bytes) -> None:
        raise RuntimeError("the broker is not reading")

    try:
        with pytest.raises(RuntimeError, match="not reading"):
            asyncio.run(run(RunSpec(chain.argv, chain.env, 60.0, 1 << 20, chain.pass_fds,
                                    grace_s=0.5), broken_sink))
    finally:
        for fd in chain.pass_fds:
            os.close(fd)
    assert call_processes(user.uid, call_id) == []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(tool=st.sampled_from([*TOOL_NAMES, "nope", ""]), args=_json)
def test_validation_only_raises_tool_errors(tool: str, args: object) -> None:
    message = "accepted"
    try:
        validate(tool, args)
    except (BadArguments, UnknownTool) as exc:
        message = str(exc)
    assert message  # any other exception type fails the test


@settings(max_examples=200, deadline=None)
@given(override=st.dictionaries(st.sampled_from([*DEFAULT_LIMITS, "bogus"]),
                                st.none() | st.booleans() | st.integers() | st.floats()
                                | st.text(max_size=3), max_size=4))
def test_limit_merge_only_raises_bad_arguments(override: dict[str, object]) -> None:
    try:
        merged = merge_limits(DEFAULT_LIMITS, override)
    except BadArguments:
        return
    for key, value in merged.items():
        assert value <= CEILING_LIMITS[key]  # type: ignore[literal-required]


def test_a_chains_shape_masks_limits_whatever_the_fds_are() -> None:
    """A call's chain and the chain probed for it differ only in per-call values; a
    pass fd whose number equals a limit's value (a busy worker's fds reach 64) must
    not change the shape (it once made every such call sandbox_unavailable)."""
    from sandbox_worker.sandbox.verify import chain_shape

    head = ["prlimit", "--nproc=64", "--as=1073741824", "--", "bwrap", "--seccomp", "{fd}",
            "--bind", "/ws", "/workspace", "--"]

    def shape(fd: int) -> tuple[str, ...]:
        return chain_shape([t.replace("{fd}", str(fd)) for t in head], ["/ws", str(fd)])

    assert shape(64) == shape(5) == shape(1073741824)
    assert "--nproc=<n>" in shape(64)
