"""The dashboard page in a real browser, over a real Dashboard whose picture the test changes.

These test the page against the data contract with a fake fleet; the end-to-end
test over a real local cluster lives with the launcher.
"""

from __future__ import annotations

from playwright.sync_api import Page, expect

from tensorfleet.dashboard import Dashboard

TASKS = ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]


def cell(page: Page, task: str, field: str):
    return page.locator(f'tr[data-task="{task}"] td[data-field="{field}"]')


def test_the_page_lists_the_tasks(browser_page: Page, dashboard: Dashboard):
    page = browser_page
    page.goto(dashboard.url)
    rows = page.locator("#task-rows tr")
    expect(rows).to_have_count(len(TASKS))
    assert [rows.nth(i).get_attribute("data-task") for i in range(len(TASKS))] == TASKS

    expect(cell(page, "ps:0", "role")).to_have_text("ps")
    expect(cell(page, "worker:0", "role")).to_have_text("chief")
    expect(cell(page, "worker:1", "state")).to_have_text("restarting")
    expect(cell(page, "worker:1", "exit_code")).to_have_text("-9")
    expect(cell(page, "worker:1", "pid")).to_have_text("—")
    expect(cell(page, "worker:2", "address")).to_have_text("127.0.0.1:41234")
    expect(cell(page, "worker:2", "step")).to_have_attribute("data-value", "5098")
    expect(cell(page, "worker:0", "loss")).to_have_text("0.1312")
    expect(page.locator("#job-name")).to_have_text("mnist_mlp")
    expect(page.locator("#global-step")).to_have_attribute("data-value", "15000")
    expect(page.locator("#connection")).to_have_attribute("data-state", "ok")


def test_changes_show_up_without_a_reload(browser_page: Page, dashboard: Dashboard, fleet):
    page = browser_page
    page.goto(dashboard.url)
    state = cell(page, "worker:2", "state")
    expect(state).to_have_text("running")
    page.evaluate("window.sameDocument = true")  # gone if the page reloads

    with fleet.lock:
        fleet.state["tasks"][4]["state"] = "restarting"
        fleet.state["job"]["global_step"] = 16000
    expect(state).to_have_text("restarting")
    expect(page.locator("#global-step")).to_have_attribute("data-value", "16000")
    expect(page.locator("#global-step")).to_have_text("16,000")

    with fleet.lock:
        fleet.state["tasks"][4].update(state="running", restarts=1)
        fleet.state["job"]["global_step"] = 17250
        fleet.state["tasks"].append({**fleet.state["tasks"][4], "name": "worker:3", "address": "127.0.0.1:41235"})
    expect(state).to_have_text("running")
    expect(cell(page, "worker:2", "restarts")).to_have_text("1")
    expect(page.locator("#global-step")).to_have_attribute("data-value", "17250")
    expect(page.locator("#task-rows tr")).to_have_count(len(TASKS) + 1)
    assert page.evaluate("window.sameDocument") is True


def test_the_indicator_says_when_the_launcher_is_gone(browser_page: Page, dashboard: Dashboard):
    page = browser_page
    page.goto(dashboard.url)
    connection = page.locator("#connection")
    expect(connection).to_have_attribute("data-state", "ok")

    dashboard.stop()
    expect(connection).to_have_attribute("data-state", "lost")
    expect(connection).to_be_visible()
    expect(connection).to_contain_text("Cannot reach the launcher")
    # The last known state stays on the page.
    expect(page.locator("#task-rows tr")).to_have_count(len(TASKS))


def test_the_indicator_tells_a_failing_picture_from_a_lost_launcher(
        browser_page: Page, dashboard: Dashboard, fleet):
    page = browser_page
    page.goto(dashboard.url)
    connection = page.locator("#connection")
    expect(connection).to_have_attribute("data-state", "ok")

    with fleet.lock:
        fleet.broken = True
    expect(connection).to_have_attribute("data-state", "lost")
    expect(connection).to_contain_text("The launcher answered HTTP 500")

    with fleet.lock:
        fleet.broken = False
    expect(connection).to_have_attribute("data-state", "ok")
    expect(connection).to_have_text("Live")


def test_a_finished_job_is_no_longer_shown_live(browser_page: Page, dashboard: Dashboard, fleet):
    page = browser_page
    page.goto(dashboard.url)
    connection = page.locator("#connection")
    expect(connection).to_have_text("Live")

    with fleet.lock:
        fleet.state["job"]["state"] = "succeeded"
        for task in fleet.state["tasks"]:
            task["state"] = "done"
    expect(connection).to_have_attribute("data-state", "finished")
    expect(connection).to_have_text("Finished")
    expect(page.locator("#job-state")).to_have_text("succeeded")
    expect(cell(page, "worker:2", "state")).to_have_text("done")


def test_markup_in_a_task_name_is_shown_as_text(browser_page: Page, dashboard: Dashboard, fleet):
    hostile = '<img src=x onerror="window.injected=1"><b>worker:9</b>'
    with fleet.lock:
        fleet.state["tasks"][4]["name"] = hostile
        fleet.state["tasks"][4]["address"] = "<script>window.injected=2</script>"
        fleet.state["job"]["name"] = "<i>job</i>"
    page = browser_page
    page.goto(dashboard.url)

    name = page.locator('#task-rows td[data-field="name"]').nth(4)
    expect(name).to_have_text(hostile)
    expect(page.locator("#task-rows tr").nth(4)).to_have_attribute("data-task", hostile)
    expect(page.locator('#task-rows td[data-field="address"]').nth(4)).to_have_text(
        "<script>window.injected=2</script>")
    expect(page.locator("#job-name")).to_have_text("<i>job</i>")
    assert page.locator("#task-rows img, #task-rows b, #task-rows script, #job-name i").count() == 0
    assert page.evaluate("window.injected") is None


def test_a_realistic_fleet(browser_page: Page, dashboard: Dashboard, fleet, save_screenshot):
    """Charts are drawn from the history; the screenshot is for people (TENSORFLEET_SCREENSHOT_DIR)."""
    page = browser_page
    page.goto(dashboard.url)
    expect(page.locator("#loss-chart canvas")).to_have_count(1)
    expect(page.locator("#throughput-chart canvas")).to_have_count(1)
    expect(page.locator("#task-rows tr")).to_have_count(len(TASKS))
    expect(page.locator("#progress-percent")).to_have_text("50.0%")
    expect(page.locator("#eta")).to_have_text("32 s")
    expect(cell(page, "worker:1", "exit_code")).to_contain_class("bad")
    save_screenshot(page, "dashboard-fake.png")

    with fleet.lock:
        fleet.state["tasks"][2]["heartbeat_age_s"] = 7.5  # running, yet silent: worth a look
    expect(cell(page, "worker:0", "heartbeat_age_s")).to_contain_class("stale")
    expect(cell(page, "worker:1", "heartbeat_age_s")).not_to_contain_class("stale")  # restarting: expected
