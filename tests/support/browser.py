"""A real headless Chromium for the dashboard's browser tests, and the federation it
looks at: a real aggregator process and real agent processes on loopback.

The browser is Debian's ``/usr/bin/chromium`` driven by Playwright (its own browser
downloads are never used).  Where either is missing the browser tests skip, except in
CI (``CI=true``), where a missing browser must not pass silently as a skipped test.

``bench/screenshots.py`` uses the same pieces to draw the documentation's screenshots.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from fedsec.demo import noise_for_demo
from fedsec.federation import (
    LocalAgent,
    agent_config,
    create_federation,
    enrol_agents,
    federation_toml,
    write_agent_config,
)

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page

CHROMIUM: Final = Path("/usr/bin/chromium")
#: No GPU, no sandbox (containers lack the namespaces), and nothing that reaches out to
#: the network on its own: the only traffic is the page's to the aggregator.
LAUNCH_ARGS: Final = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]
VIEWPORT: Final = {"width": 1280, "height": 800}
#: Playwright's own waits (clicks, selectors), in milliseconds: far above what a page
#: on loopback needs, far below the test's timeout.
ACTION_TIMEOUT_MS: Final = 15_000

TASK: Final = "breast_cancer"
PARTITION: Final = "dirichlet:0.5"
EPSILON: Final = 8.0
TRAINING: Final[dict[str, Any]] = {"local_epochs": 2, "batch_size": 16, "lr": 0.1}
#: The demo's short stage deadlines: a member that dies costs a round a few seconds.
ROUND: Final[dict[str, Any]] = {
    "min_agents": 3,
    "advertise_s": 4.0,
    "share_s": 5.0,
    "masked_s": 8.0,
    "unmask_s": 5.0,
    "open_s": 12.0,  # training time: a member killed before its masked input costs 20 s
    "max_weight_samples": 200,
}
#: How long the aggregator may take to write serve.json, and stopping processes may take.
START_S: Final = 60.0
STOP_S: Final = 10.0


# -- the browser ---------------------------------------------------------------------------------


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    return None


def require_browser() -> None:
    """Skip the calling test when there is no browser; fail it instead under CI."""
    import pytest

    reason = browser_missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the dashboard's browser tests", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def chromium(user_data_dir: Path) -> Iterator[BrowserContext]:
    """A headless Chromium with a fresh profile in ``user_data_dir``, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=str(CHROMIUM),
            headless=True,
            args=LAUNCH_ARGS,
            viewport=VIEWPORT,  # type: ignore[arg-type]
        )
        try:
            context.set_default_timeout(ACTION_TIMEOUT_MS)
            yield context
        finally:
            context.close()


@dataclass
class PageErrors:
    """Everything a page reported as wrong: console errors and uncaught exceptions."""

    messages: list[str] = field(default_factory=list)

    @classmethod
    def watch(cls, page: Page) -> PageErrors:
        errors = cls()
        page.on(
            "console",
            lambda msg: (
                errors.messages.append(f"console: {msg.text}") if msg.type == "error" else None
            ),
        )
        page.on("pageerror", lambda exc: errors.messages.append(f"pageerror: {exc}"))
        return errors


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """``check()``'s first truthy value, polled until ``timeout_s`` passes.

    Raises:
        TimeoutError: ``check`` stayed falsy; the message says what was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(every_s)


# -- the federation ------------------------------------------------------------------------------


def federation_text(
    federation_id: str,
    agents: int,
    rounds: int,
    noise_multiplier: float,
    alerts: dict[str, Any] | None = None,
    dashboard: dict[str, Any] | None = None,
) -> str:
    """federation.toml of a breast_cancer federation with the demo's short deadlines."""
    return federation_toml(
        federation_id,
        TASK,
        round_={**ROUND, "max_agents": agents, "rounds": rounds},
        training=TRAINING,
        dp={"enabled": True, "noise_multiplier": noise_multiplier, "max_grad_norm": 1.0},
        server={"port": 0},
        alerts=alerts,
        dashboard=dashboard,
    )


def noise_for(agents: int, rounds: int) -> float:
    """The noise multiplier with which the smallest member's budget lasts all rounds
    (as ``fedsec demo`` picks it)."""
    return noise_for_demo(TASK, PARTITION, agents, rounds, EPSILON, TRAINING)


@dataclass
class LocalFederation:
    """The processes of one federation under ``root``; :meth:`stop` ends them all."""

    root: Path
    agents: list[LocalAgent]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    url: str = ""

    @property
    def workspace(self) -> Path:
        return self.root / "aggregator"

    def launch(self, name: str, args: list[str]) -> None:
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        with (logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "fedsec", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    def start(self, aggregator_public: bytes, with_agents: bool = True) -> None:
        """Start the aggregator, wait for its URL (serve.json), then start the agents.

        Raises:
            RuntimeError: the aggregator exited or wrote no serve.json within START_S.
        """
        self.launch(
            "aggregator",
            ["aggregator", "serve", "--workspace", str(self.workspace), "--port", "0"],
        )
        info = self.workspace / "serve.json"
        aggregator = self.procs["aggregator"]
        deadline = time.monotonic() + START_S
        while not info.exists():
            if aggregator.poll() is not None:
                raise RuntimeError(
                    f"the aggregator exited with {aggregator.returncode}: {self.log()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the aggregator wrote no serve.json in {START_S:.0f} s")
            time.sleep(0.1)
        self.url = str(json.loads(info.read_text())["url"])
        for i, agent in enumerate(self.agents if with_agents else []):
            cfg = agent_config(
                agent,
                url=self.url,
                aggregator_public=aggregator_public,
                task=TASK,
                part_index=i,
                parts=len(self.agents),
                partition=PARTITION,
                seed=7,
                epsilon=EPSILON,
            )
            write_agent_config(agent, cfg)
            self.launch(agent.agent_id, ["agent", "run", "--config", str(agent.config_path)])

    def kill(self, name: str) -> None:
        """SIGKILL one process, as a crash would end it."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=STOP_S)

    def snapshot(self) -> dict[str, Any]:
        """The dashboard's data as the aggregator serves it now (loopback, no token)."""
        with urllib.request.urlopen(f"{self.url}/dashboard/api/snapshot", timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def kill_after_cohort_fixed(self, agent: str, timeout_s: float) -> int:
        """SIGKILL ``agent`` while a round is in advertise or share keys with every agent
        in its cohort: the cohort is fixed and no masked input can be in yet, so that
        round must close without it.  Returns the round it died in.

        Raises:
            TimeoutError: no round was in that window within ``timeout_s`` (they last a
                few hundred milliseconds each; polled every 30 ms).
        """

        def in_window() -> int | None:
            now = self.snapshot()["now"]
            if now["stage"] in ("advertise", "share_keys") and now["cohort"] == len(self.agents):
                self.kill(agent)
                return int(now["round"])
            return None

        return int(wait_until(in_window, timeout_s, "a round in advertise or share keys", 0.03))

    def log(self, name: str = "aggregator", tail: int = 3000) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM every process still running, then SIGKILL what is left after STOP_S."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_S)


@contextlib.contextmanager
def running_federation(
    root: Path,
    *,
    agents: int = 4,
    rounds: int = 30,
    alerts: dict[str, Any] | None = None,
    dashboard: dict[str, Any] | None = None,
    with_agents: bool = True,
) -> Iterator[LocalFederation]:
    """A new federation in ``root`` (created with :mod:`fedsec.federation`, so its
    operator observer is enrolled), running until the block ends; ``with_agents`` False
    starts only the aggregator."""
    noise = noise_for(agents, rounds) if with_agents else 1.0  # no agent trains
    text = federation_text("dash", agents, rounds, noise, alerts, dashboard)
    ws = create_federation(root, "dash", TASK, text)
    try:
        local = enrol_agents(ws, root, agents)
        public = ws.signer.public_bytes
    finally:
        ws.close()
    fed = LocalFederation(root, local)
    try:
        fed.start(public, with_agents)
        yield fed
    finally:
        fed.stop()
