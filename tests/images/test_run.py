"""Tool calls over image roots, through a real broker and a real T2 worker
(``--images STORE``), with images built by umoci from busybox-static and from
Debian's python3.11-minimal files.

One stack (per xdist worker); every image, workspace and host path a test
touches is under the module's tmp directory.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClient
from broker.protocol import pack, unpack
from sandbox_worker.api import rootfs_digest
from supervisor.images.store import ImageStore
from tests.helpers import Procs, eventually, searchable_dir
from tests.images.real import MARKER, build, busybox_image, need_tools, python_image
from tests.sandbox.conftest import HB_S, Stack, call_tool, start_stack, stop_all

# One worker stack for the module, also under xdist (--dist loadgroup).
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("images-run")]


@dataclass
class Images:
    home: Path
    stack: Stack
    digests: dict[str, str]
    trap: Path  # a host directory an image's symlink points at

    def rootfs(self, name: str) -> Path:
        return self.home / "images/sha256" / self.digests[name].removeprefix("sha256:") / "rootfs"

    def recorded_tree(self, name: str) -> str:
        meta = json.loads((self.rootfs(name).parent / "image.json").read_text())
        return str(meta["rootfs_sha256"])


# Package scope: under xdist the group's tests may come interleaved with other
# modules' (module scope then started the stack twice, 30 s under load).
@pytest.fixture(scope="package")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    need_tools()
    tmp = tmp_path_factory.mktemp("images-run")
    os.chmod(tmp, 0o755)
    home = tmp / "home"
    store = ImageStore(home)
    trap = tmp / "trap"
    trap.mkdir()
    digests = {
        "bb": store.import_image(busybox_image(tmp / "bb"), "bb").digest,
        "py": store.import_image(python_image(tmp / "py"), "py").digest,
        # An image whose /home is an absolute link to a host directory: a root
        # link that followed it would create and chown the user's home there.
        "trap": store.import_image(build(
            tmp / "trap-l", "t", {"/bin/busybox": Path("/bin/busybox"),
                                  "/etc/passwd": "app:x:1000:1000::/home/app:/bin/sh\n"},
            {"/bin/sh": "busybox", "/bin/echo": "busybox", "/home": str(trap)},
            ["--config.user", "app", "--config.env", "PATH=/bin"]), "trap").digest,
        "tampered": store.import_image(busybox_image(tmp / "tb", workdir="/w2"),
                                       "tampered").digest,
    }
    # Changed after import: its tree no longer hashes to what the store recorded.
    marker = (home / "images/sha256" / digests["tampered"].removeprefix("sha256:")
              / "rootfs/etc/corral-marker")
    marker.write_text("changed after import\n")
    procs = Procs(tmp)
    try:
        yield Images(home, start_stack(procs, "T2", "--images", str(home / "images")),
                     digests, trap)
    finally:
        stop_all(procs)


@pytest.fixture
async def client(images: Images) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(images.stack.frontend, heartbeat_interval_s=HB_S) as c:
        yield c


@pytest.fixture
def ws() -> Iterator[Path]:
    """A workspace under a searchable /tmp, as a user's would be."""
    with searchable_dir("corral-img-ws-", "/tmp") as path:
        yield path


async def sh(client: BrokerClient, images: Images, name: str, ws: Path,
             command: str) -> dict[str, Any]:
    r = await call_tool(client, "shell", {"command": ["/bin/sh", "-c", command]}, ws,
                        {"image": images.digests[name]})
    return r.result


async def test_shell_runs_over_the_image_root(images: Images, client: BrokerClient,
                                              ws: Path) -> None:
    assert images.stack.info["images"]["overlay"] is True
    assert images.digests["bb"] in images.stack.info["images"]["held"]
    r = await sh(client, images, "bb", ws,
                 "cat /etc/corral-marker; pwd; echo HOME=$HOME; echo V=$CORRAL_IMAGE_VAR; "
                 "test -e /usr/bin/python3 && echo HOST-ROOT; echo made > made.txt")
    assert r["outcome"] == "ok", r["output"]
    out = r["output"]
    assert MARKER in out
    assert "\n/app\n" in out
    assert "HOME=/home/app" in out
    assert "V=from-image" in out
    assert "HOST-ROOT" not in out
    assert (ws / "made.txt").read_text() == "made\n"  # the workspace is bound at WorkingDir
    iso = r["isolation"]
    assert iso["image"]["digest"] == images.digests["bb"]
    assert iso["image"]["rootfs_sha256"] == images.recorded_tree("bb")
    assert iso["image"]["workdir"] == "/app"
    assert iso["image"]["user"] == "app"
    assert iso["filesystem"] == "image-root+call-layer+rw-workspace+tmpfs"
    assert iso["seccomp"]
    assert iso["pid_namespace"]
    assert iso["network"] == "none"
    assert set(iso["kernel"]["uids"]) == {iso["uid"]}
    assert iso["uid"] > 0


async def test_changes_outside_the_workspace_live_for_one_call(
        images: Images, client: BrokerClient, ws: Path) -> None:
    first = await sh(client, images, "bb", ws,
                     "echo kept > /home/app/note && cat /home/app/note; "
                     "touch /etc/evil 2>/dev/null && echo ROOT-WRITABLE; exit 0")
    assert first["outcome"] == "ok"
    assert "kept" in first["output"]
    assert "ROOT-WRITABLE" not in first["output"]
    second = await sh(client, images, "bb", ws, "test -e /home/app/note && echo STILL; exit 0")
    assert second["outcome"] == "ok"
    assert "STILL" not in second["output"]
    # The image itself never changed.
    fd = os.open(images.rootfs("bb"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert rootfs_digest(fd) == images.recorded_tree("bb")
    finally:
        os.close(fd)


async def test_file_tools_resolve_paths_as_the_shell_sees_them(
        images: Images, client: BrokerClient, ws: Path) -> None:
    policy = {"image": images.digests["bb"]}
    w = await call_tool(client, "write_file", {"path": "/app/n.txt", "content": "x\n"}, ws,
                        policy)
    assert not w.result["is_error"], w.result["output"]
    assert (ws / "n.txt").read_text() == "x\n"
    assert w.result["isolation"]["image"]["digest"] == images.digests["bb"]
    r = await call_tool(client, "read_file", {"path": "/etc/corral-marker"}, ws, policy)
    assert r.result["output"] == MARKER
    ls = await call_tool(client, "list_dir", {"path": "/"}, ws, policy)
    assert "bin/" in ls.result["output"]
    assert "etc/" in ls.result["output"]
    seen = await sh(client, images, "bb", ws, "cat n.txt")
    assert seen["output"] == "x\n"
    bad = await call_tool(client, "write_file", {"path": "/etc/evil", "content": "x"}, ws,
                          policy)
    assert bad.result["error_kind"] == "outside_workspace"
    assert not (images.rootfs("bb") / "etc/evil").exists()


async def test_a_real_python_toolchain(images: Images, client: BrokerClient, ws: Path) -> None:
    # python3.11-minimal's standard library (no json there): csv, hashlib, pathlib.
    (ws / "hello.py").write_text(
        "import csv, hashlib, io, pathlib, sys\n"
        "rows = list(csv.reader(io.StringIO('a,b\\n1,2\\n')))\n"
        "print(sys.version_info[:2], sys.prefix, rows[1], pathlib.Path.cwd())\n"
        "print(hashlib.sha256(b'corral').hexdigest()[:12])\n")
    r = await sh(client, images, "py", ws, "pwd; python3 hello.py")
    assert r["outcome"] == "ok", r["output"]
    assert r["output"].splitlines() == ["/src", "(3, 11) /usr ['1', '2'] /src", "78e330ba9450"]


async def test_missing_or_changed_image_fails_typed_never_on_the_host(
        images: Images, client: BrokerClient, ws: Path) -> None:
    missing = await call_tool(client, "shell", {"command": "echo RAN; cat /etc/hostname"}, ws,
                              {"image": "sha256:" + "ab" * 32})
    assert missing.result["error_kind"] == "image_unavailable"
    assert missing.result["exit_code"] is None
    assert "RAN" not in missing.result["output"]
    changed = await sh(client, images, "tampered", ws, "echo RAN")
    assert changed["error_kind"] == "image_unverified", changed["output"]
    assert changed["exit_code"] is None
    assert "RAN" not in changed["output"]
    read = await call_tool(client, "read_file", {"path": "/etc/corral-marker"}, ws,
                           {"image": images.digests["tampered"]})
    assert read.result["error_kind"] == "image_unverified"


async def test_a_home_through_a_symlink_is_never_followed(
        images: Images, client: BrokerClient, ws: Path) -> None:
    r = await sh(images=images, client=client, name="trap", ws=ws,
                 command="echo HOME=$HOME")
    assert r["outcome"] == "ok", r["output"]
    assert "HOME=/tmp" in r["output"]
    assert os.listdir(images.trap) == []  # nothing made (or chowned) on the host


# A stdio MCP server by hand (the image has python3.11-minimal: no json, no
# mcp SDK); the worker's client is the official SDK.
HOST_FILE = str(Path(__file__).resolve())  # a host file the server must not see
MCP_SERVER = r"""
import ast, os, re, sys
TOK = re.compile(r'"(?:\\.|[^"\\])*"|true|false|null|[^"tfn]+|.', re.S)
LIT = {"true": "True", "false": "False", "null": "None"}
def loads(text):
    return ast.literal_eval("".join(LIT.get(t, t) for t in TOK.findall(text)))
def dumps(v):
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else
                             "\\u%04x" % ord(c) for c in v) + '"'
    if isinstance(v, dict):
        return "{" + ",".join(dumps(k) + ":" + dumps(x) for k, x in v.items()) + "}"
    return "[" + ",".join(dumps(x) for x in v) + "]"
def look(paths):
    seen = [p for p in paths if os.path.exists(p)]
    return (open("/etc/corral-marker").read() + "cwd=" + os.getcwd() + " uid=" + str(os.getuid())
            + " PATH=" + os.environ.get("PATH", "") + " host-visible=" + repr(seen))
SCHEMA = {"type": "object", "properties": {"paths": {"type": "array"}}}
while True:
    line = sys.stdin.readline()
    if not line:
        break
    msg = loads(line)
    method, params = msg.get("method"), msg.get("params") or {}
    if "id" not in msg or method is None:
        continue
    if method == "initialize":
        res = {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
               "serverInfo": {"name": "in-image", "version": "1"}}
    elif method == "tools/list":
        res = {"tools": [{"name": n, "inputSchema": SCHEMA} for n in ("look", "exit")]}
    elif method == "tools/call" and params["name"] == "exit":
        os._exit(3)
    elif method == "tools/call":
        text = look((params.get("arguments") or {}).get("paths", []))
        res = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        res = {}
    sys.stdout.write(dumps({"jsonrpc": "2.0", "id": msg["id"], "result": res}) + "\n")
    sys.stdout.flush()
"""


async def test_an_mcp_stdio_server_runs_in_the_image_with_a_layer_of_its_own(
        images: Images, client: BrokerClient, ws: Path) -> None:
    (ws / "server.py").write_text(MCP_SERVER)
    layers = Path(f"/run/corral/overlay/{images.stack.worker.pid}")

    def held() -> int:
        return len(os.listdir(layers)) if layers.exists() else 0

    async def mcp(digest: str, op: str, tool: str = "", args: Any = None) -> Any:
        spec = {"command": ["/usr/bin/python3", "-u", "server.py"]}
        body = {"call_id": f"c-mcp-{op}-{tool}", "tool": f"mcp__s__{tool or op}",
                "arguments": args or {}, "session_id": "s-mcp", "workspace": str(ws),
                "policy": {"image": digest},
                "mcp": {"server": "s", "spec": spec, "op": op, "tool": tool}}
        return unpack(await client.request("tool", pack(body), budget_s=60))

    missing = await mcp("sha256:" + "ab" * 32, "list")
    assert missing["error_kind"] == "image_unavailable", missing["output"]
    before = held()
    listed = await mcp(images.digests["py"], "list")
    assert listed["outcome"] == "ok", listed["output"]
    assert [t["name"] for t in listed["mcp_tools"]] == ["look", "exit"]
    assert held() == before + 1  # the server's layer, while it runs
    host_only = [HOST_FILE, "/usr/bin/env", str(ws / "server.py")]
    r = await mcp(images.digests["py"], "call", "look", {"paths": host_only})
    assert r["outcome"] == "ok", r["output"]
    assert MARKER in r["output"]
    iso = r["isolation"]
    assert f"cwd=/src uid={iso['uid']} PATH=/usr/bin:/bin host-visible=[]" in r["output"]
    assert iso["uid"] > 0
    assert iso["image"]["digest"] == images.digests["py"]
    assert iso["image"]["writable_layer"] == "per-server"
    assert iso["filesystem"] == "image-root+call-layer+rw-workspace+tmpfs"
    assert iso["network"] == "none"
    assert iso["seccomp"] is True
    gone = await mcp(images.digests["py"], "call", "exit")
    assert gone["error_kind"] == "mcp_server_died", gone
    await eventually(lambda: asyncio.sleep(0, held() == before), timeout_s=20,
                     what="the exited server's layer to be removed")
