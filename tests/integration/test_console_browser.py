"""The web console in a real browser: Debian's Chromium, headless, driven by Playwright,
against a real `modelkeeper up --no-demo` on free ports with a sim engine.

An admin logs in, watches a deployment go from placing/starting to serving on the
deployments page without reloading it, restarts it from its card and watches the saga's
steps appear live; a viewer finds the buttons disabled, and the same POST the button
would send is refused with a 403.

Screenshots go to tmp_path, or to the folder MODELKEEPER_CONSOLE_SCREENSHOTS names
(``docs/console`` refreshes the committed ones).

Needs /usr/bin/chromium (Debian's ``chromium`` package); skipped, saying so, without it.
Playwright downloads no browser here: it launches that one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.console.session import CSRF_HEADER
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.names import local_database_url
from modelkeeper.store.tokens import TokensStore
from tests.integration.test_readme_examples import NoDemoUp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = Path("/usr/bin/chromium")
#: Chromium as a test wants it: no sandbox (root in a container), nothing fetched from
#: the network, nothing kept between runs (a fresh profile per launch).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOTS_ENV = "MODELKEEPER_CONSOLE_SCREENSHOTS"
#: The sim engine loads this long, so that the deployment is seen starting before serving.
LOAD_TIME_S = 3
#: Playwright's wait for what the page shows (a status, a step): the console polls every
#: 2 s, a sim replica loads in LOAD_TIME_S, a restart replaces one replica.
SEEN_TIMEOUT_MS = 60_000
#: Records, in the page, each status a deployment's row shows as the live table is
#: swapped in (window.statusesSeen[id]: the statuses in order, repeats dropped).
RECORD_STATUSES = """
window.statusesSeen = {};
new MutationObserver(() => {
  for (const el of document.querySelectorAll("[id^=dep-] .status")) {
    const id = el.closest("tr").id.slice(4);
    const seen = (window.statusesSeen[id] = window.statusesSeen[id] || []);
    if (seen[seen.length - 1] !== el.dataset.status) { seen.push(el.dataset.status); }
  }
}).observe(document.body, {childList: true, subtree: true});
"""
SIM = {"model_id": "sim-console", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30,
       "engine_args": {"memory_bytes": 64 << 20, "load_time_s": LOAD_TIME_S}}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[NoDemoUp]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (Debian's chromium package)")
    up = NoDemoUp(tmp_path / "data")
    try:
        up.start()
        yield up
    finally:
        up.kill_everything()


def _viewer_token(up: NoDemoUp) -> str:
    dsn = local_database_url("127.0.0.1", up.ports["postgres"], data_dir=up.data_dir)

    async def create() -> str:
        async with await TokensStore.connect(dsn) as tokens:
            _, token = await tokens.create_token("victor", OperatorRole.VIEWER)
            return token
    return asyncio.run(create())


def test_the_console_deploys_restarts_live_and_refuses_a_viewer(
        stack: NoDemoUp, tmp_path: Path) -> None:
    from playwright.sync_api import Page, expect, sync_playwright

    api = f"http://127.0.0.1:{stack.ports['api']}"
    admin_token = (stack.data_dir / "operator-token").read_text().strip()
    viewer_token = _viewer_token(stack)
    shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    resp = httpx.post(f"{api}/models", json=SIM, headers=stack.operator(), timeout=10)
    assert resp.status_code == 201, resp.text

    def login(page: Page, token: str) -> None:
        page.goto(f"{api}/ui")
        expect(page).to_have_url(f"{api}/ui/login")
        page.fill("input[name=token]", token)
        page.click("button[type=submit]")
        expect(page).to_have_url(f"{api}/ui")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                             args=CHROMIUM_ARGS)
        try:
            admin = browser.new_context(viewport={"width": 1280, "height": 800})
            page = admin.new_page()
            page.on("dialog", lambda dialog: dialog.accept())  # each action's confirmation
            page.goto(f"{api}/ui/login")
            page.fill("input[name=token]", "mko-not-a-token")
            page.click("button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("not an active operator")
            page.screenshot(path=str(shots / "login.png"))
            login(page, admin_token)

            # Deployed from outside; the open page sees it arrive and turn serving.
            page.goto(f"{api}/ui/deployments")
            page.evaluate("document.body.dataset.loadedOnce = 'yes'")
            page.evaluate(RECORD_STATUSES)
            created = httpx.post(f"{api}/deployments", json={"model_id": SIM["model_id"]},
                                 headers=stack.operator(), timeout=30)
            assert created.status_code == 201, created.text
            deployment_id = created.json()["deployment_id"]
            status = page.locator(f"#dep-{deployment_id} .status")
            expect(status).to_have_text(re.compile("^(placing|starting)$"),
                                        timeout=SEEN_TIMEOUT_MS)
            page.screenshot(path=str(shots / "deployments-starting.png"))
            expect(status).to_have_text("serving", timeout=SEEN_TIMEOUT_MS)
            assert page.evaluate("document.body.dataset.loadedOnce") == "yes"  # no reload
            statuses = page.evaluate(f"window.statusesSeen['{deployment_id}']")
            assert statuses[-1] == "serving" and len(statuses) >= 2, statuses
            page.screenshot(path=str(shots / "deployments.png"))

            # Restart from the card: the operation it started, then its steps, live.
            page.click(f"#dep-{deployment_id} a")
            expect(page.locator("#card-status")).to_have_text("serving")
            page.evaluate("document.body.dataset.loadedOnce = 'yes'")
            page.click("#act-restart")
            link = page.locator("#result .op-link")
            expect(link).to_have_text(re.compile(rf"^restart/{deployment_id}/\d+$"))
            operation_id = link.inner_text()
            steps = page.locator("#result li.step")
            expect(steps.first).to_be_visible(timeout=SEEN_TIMEOUT_MS)
            page.screenshot(path=str(shots / "restart-running.png"))
            expect(page.locator("#result .opstate")).to_have_text(
                "succeeded", timeout=SEEN_TIMEOUT_MS)
            step_names = steps.evaluate_all("els => els.map(e => e.dataset.step)")
            assert step_names, step_names
            assert page.evaluate("document.body.dataset.loadedOnce") == "yes"
            # The card itself catches up at its next refresh.
            expect(page.locator("#card-operations .opstate").first).to_have_text(
                "succeeded", timeout=SEEN_TIMEOUT_MS)
            expect(page.locator("#card-operations")).to_contain_text(operation_id)
            expect(page.locator("#replicas tbody tr")).to_have_count(1)
            page.screenshot(path=str(shots / "deployment-card.png"), full_page=True)
            page.goto(f"{api}/ui/operations/{operation_id}")
            expect(page.locator(".oplive .opstate")).to_have_text("succeeded")
            for name in ("fleet", "nodes", "operations"):
                page.goto(f"{api}/ui" + ("" if name == "fleet" else f"/{name}"))
                page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

            # The event stream: an entry recorded now appears on the open page.
            page.goto(f"{api}/ui/events")
            expect(page.locator("#stream-state")).to_have_text("live")
            page.evaluate("document.body.dataset.loadedOnce = 'yes'")
            [node] = httpx.get(f"{api}/nodes", headers=stack.operator(), timeout=10).json()
            labelled = httpx.patch(f"{api}/nodes/{node['node_id']}", timeout=10,
                                   headers=stack.operator(), json={"labels": {"rack": "r1"}})
            assert labelled.status_code == 200, labelled.text
            expect(page.locator("#event-rows tr.fresh").first).to_contain_text(
                "'rack': 'r1'", timeout=SEEN_TIMEOUT_MS)
            assert page.evaluate("document.body.dataset.loadedOnce") == "yes"
            page.screenshot(path=str(shots / "events.png"))

            # A viewer: no button acts, and the request a button would send is a 403.
            viewer = browser.new_context(viewport={"width": 1280, "height": 800})
            page = viewer.new_page()
            login(page, viewer_token)
            page.goto(f"{api}/ui/deployments/{deployment_id}")
            for action in ("scale", "restart", "retry", "delete", "switch", "reconfigure"):
                expect(page.locator(f"#act-{action}")).to_be_disabled()
            page.screenshot(path=str(shots / "viewer-card.png"))
            # With the viewer's own CSRF token, from this origin: refused for the role.
            sent = json.loads(page.get_attribute("body", "hx-headers") or "{}")
            assert set(sent) == {CSRF_HEADER}, sent
            refused = viewer.request.post(
                f"{api}/ui/deployments/{deployment_id}/restart",
                headers={**sent, "Origin": api})
            assert refused.status == 403, refused.text()
            assert "needs an admin token" in refused.text()
        finally:
            browser.close()
    operations = httpx.get(f"{api}/operations", headers=stack.operator(), timeout=10).json()
    assert [o["operation_id"] for o in operations] == [operation_id]  # the viewer's: none
    print(f"\nthe deployments page showed {' -> '.join(statuses)}; restart steps: "
          f"{step_names}")
