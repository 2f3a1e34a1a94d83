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


def test_a_stopped_job_is_finished_and_not_failed(browser_page: Page, dashboard: Dashboard, fleet):
    page = browser_page
    page.goto(dashboard.url)
    with fleet.lock:
        fleet.state["job"]["state"] = "stopped"
        for task in fleet.state["tasks"]:
            task.update(state="stopped", exit_code=None)
    expect(page.locator("#connection")).to_have_text("Finished")
    expect(page.locator("#job-state")).to_have_text("stopped")
    expect(page.locator("#job-state")).to_have_class("badge state-stopped")
    expect(cell(page, "worker:2", "state").locator("span")).to_have_class("badge state-stopped")


def test_tasks_refusing_the_dashboard_are_said_on_the_page(browser_page: Page, dashboard: Dashboard, fleet):
    page = browser_page
    page.goto(dashboard.url)
    problem = page.locator("#job-problem")
    expect(problem).to_be_hidden()
    with fleet.lock:
        fleet.state["job"]["problem"] = "ps:0 refuses this dashboard's Status calls: set TENSORFLEET_TOKEN"
        fleet.state["tasks"][0]["state"] = "refused"
    expect(problem).to_be_visible()
    expect(problem).to_contain_text("set TENSORFLEET_TOKEN")
    expect(cell(page, "ps:0", "state")).to_have_text("refused")
    expect(cell(page, "ps:0", "state").locator("span")).to_have_class("badge state-refused")
    with fleet.lock:
        fleet.state["job"]["problem"] = None
    expect(problem).to_be_hidden()


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


def test_embedding_tables_show_only_for_a_job_with_tables(browser_page: Page, dashboard: Dashboard, fleet):
    with fleet.lock:  # a job without tables, as the monitor pictures one
        for task in fleet.state["tasks"]:
            task.update(tables=None, unique_ids=None)
        fleet.state["job"].update(table_rows=None, rows_per_sec=None)
    page = browser_page
    page.goto(dashboard.url)
    expect(cell(page, "worker:2", "state")).to_have_text("running")
    expect(page.locator("#embedding-tables")).to_be_hidden()
    expect(cell(page, "worker:0", "unique_ids")).to_be_hidden()
    expect(page.locator("#tasks th", has_text="Unique ids")).to_be_hidden()

    with fleet.lock:
        tasks = fleet.state["tasks"]
        tasks[0]["tables"] = {"users": {"rows": 120000, "bytes": 61_440_000, "rows_per_sec": 850.5},
                              "items": {"rows": 3000, "bytes": 1_536_000, "rows_per_sec": 12.0}}
        tasks[1]["tables"] = {"users": {"rows": 119000, "bytes": 60_928_000, "rows_per_sec": None},
                              "items": {"rows": 2900, "bytes": 1_484_800, "rows_per_sec": 11.5}}
        tasks[2]["unique_ids"], tasks[4]["unique_ids"] = 4096, 3871
        fleet.state["job"].update(table_rows=244900, rows_per_sec=874.0)
    section = page.locator("#embedding-tables")
    expect(section).to_be_visible()
    rows = page.locator("#table-rows tr")
    expect(rows).to_have_count(4)
    assert [(rows.nth(i).get_attribute("data-table"), rows.nth(i).get_attribute("data-shard"))
            for i in range(4)] == [("users", "ps:0"), ("users", "ps:1"), ("items", "ps:0"), ("items", "ps:1")]

    def table_cell(table: str, shard: str, field: str):
        return page.locator(f'#table-rows tr[data-table="{table}"][data-shard="{shard}"] td[data-field="{field}"]')

    expect(table_cell("users", "ps:0", "rows")).to_have_text("120,000")
    expect(table_cell("users", "ps:0", "bytes")).to_have_text("61.4")  # MB
    expect(table_cell("users", "ps:0", "bytes")).to_have_attribute("data-value", "61440000")
    expect(table_cell("users", "ps:0", "rows_per_sec")).to_have_text("851")
    expect(table_cell("users", "ps:1", "rows_per_sec")).to_have_text("—")
    expect(table_cell("items", "ps:1", "rows")).to_have_text("2,900")
    expect(table_cell("items", "ps:1", "bytes")).to_have_text("1.5")
    expect(table_cell("items", "ps:1", "rows_per_sec")).to_have_text("11.5")
    expect(page.locator("#table-total")).to_have_text("244,900 rows · 874 rows / s")
    expect(cell(page, "worker:0", "unique_ids")).to_be_visible()
    expect(cell(page, "worker:0", "unique_ids")).to_have_text("4,096")
    expect(cell(page, "worker:2", "unique_ids")).to_have_text("3,871")
    expect(cell(page, "ps:0", "unique_ids")).to_have_text("—")

    with fleet.lock:  # no tables any more: the section and the column go with them
        for task in fleet.state["tasks"]:
            task.update(tables=None, unique_ids=None)
    expect(section).to_be_hidden()
    expect(rows).to_have_count(0)
    expect(cell(page, "worker:0", "unique_ids")).to_be_hidden()
