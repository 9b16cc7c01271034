"""Screenshots of the operator dashboard for the documentation (docs/img/dashboard-*.png).

Runs a real federation (an aggregator and four agents, each its own process, on
breast_cancer with the demo's short deadlines), lets it close some rounds, kills one
agent with SIGKILL after its cohort is fixed so that a participation_dropped alert
opens, lets a few more rounds close, then saves a 1280x800 screenshot of each view
from Debian's headless Chromium.  Takes about a minute.

Run from the repository root: ``.venv/bin/python bench/screenshots.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support is not installed with the package

from tests.support.browser import (  # noqa: E402
    LocalFederation,
    PageErrors,
    browser_missing,
    chromium,
    running_federation,
    wait_until,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

VIEWS = ("now", "rounds", "members", "alerts", "models")
#: Rounds closed before the kill, and after it, so every chart shows a trend and the dip.
ROUNDS_BEFORE = 6
ROUNDS_AFTER = 4
#: Bounds of the waits (seconds): generous for 2 cores; the run gives up past them.
WAIT_S = 180.0
#: How long to wait for the "now" view to show a countdown before taking it anyway.
COUNTDOWN_S = 30.0
#: A pushed update reaches the page within a second; this lets a view settle.
SETTLE_MS = 1200


def _completed(fed: LocalFederation) -> int:
    return int(fed.snapshot()["now"]["rounds_completed"])


def _wait_for_countdown(page: Page) -> None:
    """The "now" view reads best mid-stage, with a deadline counting down; after
    COUNTDOWN_S it is taken as it is."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(
            # a function, not an expression: the page's CSP forbids eval
            "() => /^[0-9]+ s$/.test("
            "document.querySelector('[data-testid=now-deadline]').textContent)",
            timeout=COUNTDOWN_S * 1000,
            polling=50,
        )


def main() -> None:
    """Run the federation, take one screenshot per view, print where they went."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        sys.exit(f"cannot take screenshots: {missing}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fedsec-screenshots-"))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (
        running_federation(work / "fed", alerts={"participation_min": 1.0}) as fed,
        chromium(work / "profile") as browser,
    ):
        page = browser.new_page()
        errors = PageErrors.watch(page)
        page.goto(f"{fed.url}/dashboard")
        wait_until(lambda: _completed(fed) >= ROUNDS_BEFORE, WAIT_S, "the first rounds")
        died_in = fed.kill_after_cohort_fixed("agent-4", WAIT_S)
        wait_until(
            lambda: _completed(fed) >= died_in + ROUNDS_AFTER,
            WAIT_S,
            "rounds after the kill",
        )
        for view in VIEWS:
            page.get_by_test_id(f"tab-{view}").click()
            page.wait_for_timeout(SETTLE_MS)
            if view == "now":
                _wait_for_countdown(page)
            path = args.out / f"dashboard-{view}.png"
            page.screenshot(path=str(path))
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    if errors.messages:
        sys.exit("the page reported errors:\n" + "\n".join(errors.messages))
    print(f"done in {time.monotonic() - started:.0f} s; federation in {work}")


if __name__ == "__main__":
    main()
