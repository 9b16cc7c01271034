"""The operator dashboard in a real headless Chromium, against a real federation.

A real aggregator process and four real agent processes train breast_cancer; the page
is opened on loopback the way the operator on the aggregator's machine opens it.  The
round shown must advance while the run goes on, over the live event stream; an agent
killed with SIGKILL after the cohort is fixed must show up as an open
participation_dropped alert; every view must render its rows; and the page must run
under its Content-Security-Policy without one console error.  Distributed-DP rounds in
the history show their realised noise and wraps, and a round whose sum had coordinates
at the ring's edge is flagged.  With loopback closed
(``[dashboard] loopback_open = false``) the page is refused without a token, offering
its sign-in form, and opens with one posted there, which then lives only in an
HttpOnly cookie and never in an address.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedsec.federation import OBSERVER_ID, create_federation, enrol_agents
from tests.support.browser import (
    TASK,
    LocalFederation,
    PageErrors,
    chromium,
    federation_text,
    require_browser,
    running_federation,
    wait_until,
)
from tests.support.round_history import seed_rounds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

#: Bounds of the waits below, in seconds.  Agents take ~15 s to start on 2 cores and
#: a round a few seconds; a member killed before its masked input holds its round
#: until the masked-input deadline (masked_s + open_s = 20 s).  A machine running
#: other work beside the suite stretches a round several-fold: a bound is a deadline
#: for a hang, not a timing check.
FIRST_ROUND_S = 90.0
ADVANCE_S = 120.0
KILL_WINDOW_S = 60.0
ALERT_S = 90.0
UI_MS = 15_000  # an update pushed at most once a second reaches the page well within this


def _shown_int(page: Any, test_id: str) -> int | None:
    match = re.fullmatch(r"\d+", page.get_by_test_id(test_id).text_content() or "")
    return int(match.group()) if match else None


def test_dashboard_follows_a_live_federation_and_shows_a_dropped_member(
    tmp_path: Path,
) -> None:
    require_browser()
    from playwright.sync_api import expect

    with (
        # five members: one can die (t = 3 of 4 neighbours holds against one colluder)
        running_federation(tmp_path / "fed", agents=5, alerts={"participation_min": 1.0}) as fed,
        chromium(tmp_path / "profile") as browser,
    ):
        page = browser.new_page()
        errors = PageErrors.watch(page)
        response = page.goto(f"{fed.url}/dashboard")
        assert response is not None and response.status == 200
        assert "script-src 'self'" in response.headers["content-security-policy"]
        expect(page.get_by_test_id("connection-state")).to_have_text("live", timeout=UI_MS)

        # the round shown advances while the federation runs
        first = wait_until(
            lambda: _shown_int(page, "now-round"), FIRST_ROUND_S, "a round number on the page"
        )
        wait_until(
            lambda: (_shown_int(page, "now-round") or 0) > first,
            ADVANCE_S,
            f"the round shown moving past {first}",
        )
        expect(page.get_by_test_id("connection-state")).to_have_text("live")
        assert re.fullmatch(r"\d+ / 30", page.get_by_test_id("rounds-completed").inner_text())
        for tile in ("now-attempt", "now-joined", "now-accepted", "now-refused", "now-dropped"):
            assert _shown_int(page, tile) is not None, tile

        # a member dies mid-round: its round closes without it and an alert opens
        died_in = fed.kill_after_cohort_fixed("agent-4", KILL_WINDOW_S)
        open_alert = page.locator('[data-testid="alert-row"][data-state="open"]')
        open_alert.first.wait_for(state="attached", timeout=ALERT_S * 1000)
        assert open_alert.first.get_attribute("data-kind") == "participation_dropped"
        expect(page.get_by_test_id("alerts-badge")).to_have_text(str(open_alert.count()))

        # every view renders, from its tab and from its address
        for view, row in (
            ("rounds", "round-row"),
            ("members", "member-row"),
            ("alerts", "alert-row"),
            ("models", "model-row"),
            ("now", None),
        ):
            page.get_by_test_id(f"tab-{view}").click()
            assert page.url.endswith(f"#{view}")
            expect(page.locator(f"section[data-view={view}]")).to_be_visible()
            if row is not None:
                expect(page.get_by_test_id(row).first).to_be_visible()
        # the round agent-4 died in closed with the other three (cohort 4, survivors 3)
        died = page.locator(f'[data-testid="round-row"][data-round="{died_in}"][data-stage=closed]')
        expect(died.locator("[data-col=cohort]")).to_have_text(str(len(fed.agents)))
        expect(died.locator("[data-col=survivors]")).to_have_text(str(len(fed.agents) - 1))
        members = page.get_by_test_id("member-row")
        assert sorted(members.all_inner_texts())[0].startswith("agent-1")
        assert members.count() == len(fed.agents) + 1  # and the operator
        assert re.search(r"\d+s ago", page.locator('[data-member="agent-1"]').inner_text())
        expect(page.locator('[data-testid="model-row"][data-latest="true"]')).to_have_count(1)
        page.goto(f"{fed.url}/dashboard#alerts")
        expect(page.locator("section[data-view=alerts]")).to_be_visible()
        expect(page.locator("section[data-view=now]")).to_be_hidden()
        expect(open_alert.first).to_contain_text(f"round {died_in} ")
        expect(open_alert.first).to_contain_text("4 of its 5")
        expect(page.get_by_test_id("connection-state")).to_have_text("live", timeout=UI_MS)

        assert errors.messages == []


def _issue_dashboard_token(workspace: Path) -> str:
    """A token from the CLI, as the operator gets one (stdout: the token alone)."""
    issued = subprocess.run(
        [
            *(sys.executable, "-m", "fedsec", "aggregator", "dashboard-token"),
            *("--workspace", str(workspace), "--observer", OBSERVER_ID, "--ttl-s", "600"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip()
    assert re.fullmatch(r"fdt_[0-9a-f]{64}", token), issued.stdout
    return token


def test_dashboard_needs_a_token_when_loopback_is_closed(tmp_path: Path) -> None:
    require_browser()
    from playwright.sync_api import expect

    with (
        running_federation(
            tmp_path / "fed", dashboard={"loopback_open": False}, with_agents=False
        ) as fed,
        chromium(tmp_path / "profile") as browser,
    ):
        page = browser.new_page()
        addresses: list[str] = []
        page.on("request", lambda request: addresses.append(request.url))
        refused = page.goto(f"{fed.url}/dashboard")
        assert refused is not None and refused.status == 401  # the sign-in form
        assert page.get_by_test_id("now-round").count() == 0
        assert browser.request.get(f"{fed.url}/dashboard/api/snapshot").status == 401
        page.get_by_test_id("sign-in-token").fill(f"fdt_{'0' * 64}")
        with page.expect_navigation() as forged:
            page.get_by_test_id("sign-in").click()
        assert forged.value is not None and forged.value.status == 401
        assert browser.cookies() == []

        token = _issue_dashboard_token(fed.workspace)
        page.get_by_test_id("sign-in-token").fill(token)
        with page.expect_navigation(url=f"{fed.url}/dashboard") as signed_in:
            page.get_by_test_id("sign-in").click()
        opened = signed_in.value
        assert opened is not None and opened.status == 200
        assert opened.request.redirected_from is not None  # the 303 that set the cookie
        assert opened.request.redirected_from.method == "POST"
        assert page.url == f"{fed.url}/dashboard"
        assert not any(token in address for address in addresses)  # never in an address
        (cookie,) = browser.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert cookie["value"] == token
        expect(page.get_by_test_id("connection-state")).to_have_text("live", timeout=UI_MS)
        expect(page.get_by_test_id("federation-id")).to_have_text("dash")
        expect(page.get_by_test_id("replica-role")).to_have_text("single")
        assert _shown_int(page, "now-round") is not None
        # the cookie alone keeps the session: a reload needs no token
        reloaded = page.reload()
        assert reloaded is not None and reloaded.status == 200
        expect(page.get_by_test_id("connection-state")).to_have_text("live", timeout=UI_MS)


def test_rounds_table_shows_distributed_dp_wraps_and_flags_wrapped_rounds(
    tmp_path: Path,
) -> None:
    require_browser()
    from playwright.sync_api import expect

    root = tmp_path / "fed"
    ws = create_federation(root, "dash", TASK, federation_text("dash", 4, 30, 1.0))
    try:
        local = enrol_agents(ws, root, 4)
        seed_rounds(ws)  # rounds 1 (plain), 2 (no wrap) and 3 (three coordinates wrapped)
        public = ws.signer.public_bytes
    finally:
        ws.close()
    fed = LocalFederation(root, local)
    try:
        fed.start(public, with_agents=False)
        with chromium(tmp_path / "profile") as browser:
            page = browser.new_page()
            errors = PageErrors.watch(page)
            response = page.goto(f"{fed.url}/dashboard#rounds")
            assert response is not None and response.status == 200
            expect(page.get_by_test_id("connection-state")).to_have_text("live", timeout=UI_MS)

            def row(round_: int) -> Any:
                return page.locator(f'[data-testid="round-row"][data-round="{round_}"]')

            expect(row(3).locator("[data-col=wraps]")).to_have_text("3 / 5,211", timeout=UI_MS)
            expect(row(3)).to_have_class(re.compile(r"\bwrapped\b"))
            expect(row(3).locator("[data-col=wraps]")).to_have_class(re.compile(r"\bfail\b"))
            expect(row(3).locator("[data-col=wraps]")).to_have_attribute(
                "title", re.compile(r"^0\.058% .*likely wrapped")
            )
            expect(row(3).locator("[data-col=noise]")).to_have_text("0.861")
            expect(row(2).locator("[data-col=wraps]")).to_have_text("0 / 5,211")
            expect(row(2)).not_to_have_class(re.compile(r"\bwrapped\b"))
            expect(row(2).locator("[data-col=wraps]")).not_to_have_class(re.compile(r"\bfail\b"))
            expect(row(2).locator("[data-col=noise]")).to_have_text("0.873")
            # a round that was not distributed DP has neither
            expect(row(1).locator("[data-col=wraps]")).to_have_text("\u2014")
            expect(row(1).locator("[data-col=noise]")).to_have_text("\u2014")
            expect(row(1)).not_to_have_class(re.compile(r"\bwrapped\b"))
            # the flag is drawn: the wrapped row's first cell carries the red stripe
            stripe = row(3).locator("td").first.evaluate("td => getComputedStyle(td).boxShadow")
            assert "inset" in stripe, stripe
            plain = row(2).locator("td").first.evaluate("td => getComputedStyle(td).boxShadow")
            assert plain == "none", plain
            assert errors.messages == []
    finally:
        fed.stop()
