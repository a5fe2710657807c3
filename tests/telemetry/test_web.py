"""The farm web view: served by a real farm's supervisor, loaded in a real
headless Chromium (Debian's package, driven by playwright), where a new
session appears and its events stream live; plus its access rules (loopback
Host check, token, read-only, security headers) over plain HTTP."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.client import SupervisorClient
from supervisor.telemetry.web import SECURITY_HEADERS, TOKEN_FILE, WebView

pytestmark = pytest.mark.timeout(180)

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "echo hi"}}],
     "usage": {"input": 20, "output": 5}},
    {"text": "done <b>not html</b>", "usage": {"input": 30, "output": 6}},
]}
DOCS = Path(__file__).resolve().parents[2] / "docs"
HAVE_CHROMIUM = os.path.exists(CHROMIUM)
SCREENSHOT = DOCS / "web-view.png"


def _check_headers(resp: httpx.Response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert resp.headers.get(name) == value, name


@pytest.mark.skipif(not HAVE_CHROMIUM, reason="Debian's chromium is not installed "
                    "(scripts/_bootstrap.sh installs it with the test extra)")
async def test_web_view_in_a_real_browser(telemetry_farm: Callable[..., Any],
                                          workspace_root: Path, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    # corral up --web (Farm's override; the metrics test covers corral.toml's key)
    farm = await telemetry_farm(SCRIPT, web="127.0.0.1:0")
    url = farm.ready()["web"]
    assert url.startswith("http://127.0.0.1:")
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    async with httpx.AsyncClient(timeout=10) as http:
        page = await http.get(url)
        assert page.status_code == 200
        _check_headers(page)
        # Read-only; a page from another name (DNS rebinding) is refused.
        assert (await http.post(url + "api/farm")).status_code == 405
        rebind = await http.get(url + "api/farm", headers={"Host": f"evil.example:{port}"})
        assert rebind.status_code == 403
        _check_headers(rebind)
        assert not (farm.home / TOKEN_FILE).exists()  # loopback: no token made
    ws = workspace_root / "ws"
    ws.mkdir()
    async with async_playwright() as pw:
        ctx = await pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=FLAGS, viewport={"width": 1280, "height": 900})
        try:
            browser_page = await ctx.new_page()
            await browser_page.goto(url)
            await browser_page.wait_for_selector("#conn.ok", timeout=30_000)
            await browser_page.wait_for_selector(".worker", timeout=30_000)
            async with SupervisorClient(farm.endpoint) as sv:
                sid = await sv.create_session(workspace=str(ws))
                # The new session appears (the page was loaded before it existed).
                await browser_page.wait_for_selector(f'tr[data-session="{sid}"]',
                                                     timeout=30_000)
                await browser_page.click(f'tr[data-session="{sid}"]')
                await sv.submit(sid, {"type": "user_input", "text": "run echo"})
                # Its events stream in live, up to the turn's end.
                await browser_page.wait_for_selector('#events li[data-type="turn_complete"]',
                                                     timeout=60_000)
            types = await browser_page.eval_on_selector_all(
                "#events li", "els => els.map(e => e.dataset.type)")
            for t in ("turn_started", "tool_call_begin", "tool_call_end", "turn_complete"):
                assert t in types, types
            # Server text is text, never markup.
            assert await browser_page.locator("#events b").count() == 0
            # (a locator, not wait_for_function: the page's CSP forbids eval)
            await expect(browser_page.locator('[data-chart="tool calls"] .v')).to_have_text(
                "1", timeout=30_000)
            shot = tmp_path / "web-view.png"
            await browser_page.screenshot(path=str(shot), full_page=True)
        finally:
            await ctx.close()
    assert shot.stat().st_size > 10_000
    # The README's screenshot: refreshed with CORRAL_SCREENSHOTS=1 (or made when
    # missing), so that an ordinary test run leaves the work tree clean.
    if os.environ.get("CORRAL_SCREENSHOTS") == "1" or not SCREENSHOT.exists():
        shutil.copyfile(shot, SCREENSHOT)
        SCREENSHOT.chmod(0o644)


class _NoSessions:
    sessions: dict[str, Any] = {}


async def _status() -> dict[str, Any]:
    return {"broker": {"workers": {}, "queues": {}}, "sessions": {}}


async def test_a_non_loopback_address_needs_the_token(tmp_path: Path) -> None:
    web = WebView("0.0.0.0:0", manager=_NoSessions(), snapshot=_status,  # type: ignore[arg-type]
                  home=tmp_path, loop=asyncio.get_running_loop())
    url = web.start()
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    base = f"http://127.0.0.1:{port}"
    try:
        token_file = tmp_path / TOKEN_FILE
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        async with httpx.AsyncClient(timeout=10) as http:
            for attempt in ({}, {"Authorization": "Bearer wrong"},
                            {"Cookie": "corral_web=wrong"}):
                resp = await http.get(base + "/api/farm", headers=attempt)
                assert resp.status_code == 403, attempt
                _check_headers(resp)
            assert (await http.get(base + "/?token=nope")).status_code == 403
            first = await http.get(base + "/?token=" + token)
            assert first.status_code == 200
            cookie = first.headers["set-cookie"]
            assert "HttpOnly" in cookie
            assert "SameSite=Strict" in cookie
            farm = await http.get(base + "/api/farm",
                                  headers={"Cookie": cookie.split(";")[0]})
            assert farm.status_code == 200
            assert farm.json()["sessions"] == []
            bearer = await http.get(base + "/api/farm",
                                    headers={"Authorization": f"Bearer {token}"})
            assert bearer.status_code == 200
            assert (await http.delete(base + "/api/farm")).status_code == 405
    finally:
        await asyncio.to_thread(web.stop)
    # The same token next time (stored), not a new one per start.
    again = WebView("0.0.0.0:0", manager=_NoSessions(), snapshot=_status,  # type: ignore[arg-type]
                    home=tmp_path, loop=asyncio.get_running_loop())
    assert again.token == token


APPROVAL_SCRIPT = {"responses": [
    {"tool_calls": [{"name": "shell", "arguments": {"command": "echo waiting"}}]}]}


async def test_a_pending_approval_shows_among_many_sessions(
        telemetry_farm: Callable[..., Any], workspace_root: Path) -> None:
    """The view is bounded (MAX_SESSIONS_SHOWN) but an old session waiting for
    an approval is still there, with its approval, after many newer ones."""
    from supervisor.telemetry.web import MAX_SESSIONS_SHOWN
    from tests.helpers import eventually

    farm = await telemetry_farm(APPROVAL_SCRIPT, workers=1,
                                extra='[web]\nlisten = "127.0.0.1:0"\n')
    base = farm.ready()["web"].rstrip("/")
    ws = workspace_root / "ws"
    ws.mkdir()
    async with SupervisorClient(farm.endpoint) as sv:
        waiting = await sv.create_session(workspace=str(ws), approval="ask")
        await sv.submit(waiting, {"type": "user_input", "text": "run it"})

        async def asked() -> bool:
            d = await sv.describe(waiting)
            return bool((d.get("state") or d).get("pending_approval"))

        await eventually(asked, timeout_s=60, what="the approval request")
        newer = MAX_SESSIONS_SHOWN + 5
        for _ in range(newer):
            await sv.create_session(workspace=str(ws))
    async with httpx.AsyncClient(timeout=30) as http:
        farm_view = (await http.get(base + "/api/farm")).json()
    assert farm_view["sessions_total"] == newer + 1
    assert len(farm_view["sessions"]) == MAX_SESSIONS_SHOWN
    assert waiting in {s["session_id"] for s in farm_view["sessions"]}
    assert [a["session_id"] for a in farm_view["approvals"]] == [waiting]


async def test_the_loopback_host_check_reads_every_form_of_host(tmp_path: Path) -> None:
    """A loopback view answers a Host naming loopback in any form (an IPv6
    literal with or without its port) and refuses any other name."""
    import http.client

    web = WebView("127.0.0.1:0", manager=_NoSessions(), snapshot=_status,  # type: ignore[arg-type]
                  home=tmp_path, loop=asyncio.get_running_loop())
    port = int(web.start().rstrip("/").rsplit(":", 1)[1])

    def get(host: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.putrequest("GET", "/", skip_host=True)
            conn.putheader("Host", host)
            conn.endheaders()
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "[::1]"):
            assert await asyncio.to_thread(get, host) == 200, host
        for host in ("evil.example", f"evil.example:{port}", "[::1", "127.0.0.1.evil:80"):
            assert await asyncio.to_thread(get, host) == 403, host
    finally:
        await asyncio.to_thread(web.stop)
