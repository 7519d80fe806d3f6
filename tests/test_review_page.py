"""The review page in a real headless browser (Debian's chromium driven by Selenium) against
a real uvicorn server: the key is given once, two answers are marked with the keyboard (one
correct, one incorrect with the right answer), one skipped, and the labels reach the audit
store with source "review". A screenshot is written to /tmp/review.png."""

from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from serve_helpers import ServerThread, save_tiny_detector  # noqa: E402
from test_served_store import ask_all, served_app  # noqa: E402

from actmap.serve.audit import open_audit_store  # noqa: E402

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
KEY = "page-key"
SCREENSHOT = "/tmp/review.png"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver (`make test` installs them with apt)",
)


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1000,900"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def shown_map_id(driver) -> str:
    return driver.find_element(By.ID, "map_id").text


def press(driver, key: str) -> None:
    driver.find_element(By.TAG_NAME, "body").send_keys(key)


def test_review_page_marks_two_answers_and_the_labels_reach_the_store(tmp_path, browser):
    run = tmp_path / "run"
    save_tiny_detector(run)
    root = tmp_path / "audit"
    app = served_app(run, root, api_key=KEY)
    with ServerThread(app) as server:
        blocks = ask_all(server.url, 10, api_key=KEY)
        app.state.actmap.engine.audit.flush()
        queued = open_audit_store(root).read_table("review").to_pandas()
        assert len(queued) >= 3, "the queue needs three answers for this test"
        wait = WebDriverWait(browser, 30)
        browser.get(server.url + "/review")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "connect").click()
        wait.until(lambda d: d.find_element(By.ID, "item").is_displayed())
        assert browser.find_element(By.ID, "key").get_attribute("value") == ""  # not kept there

        first = shown_map_id(browser)
        served = {b["map_id"]: b for b in blocks}
        assert browser.find_element(By.ID, "decision").text == served[first]["decision"]
        shown_p = float(browser.find_element(By.ID, "p").text)
        assert shown_p == pytest.approx(served[first]["p_correct"], abs=5e-4)
        assert browser.find_element(By.ID, "question").text != "(not kept)"
        press(browser, "c")
        wait.until(lambda d: shown_map_id(d) != first)

        second = shown_map_id(browser)
        browser.find_element(By.ID, "correct_answer").send_keys("the right answer is rome")
        browser.find_element(By.ID, "question").click()  # leave the text box: keys work again
        press(browser, "i")
        wait.until(lambda d: shown_map_id(d) != second)
        assert browser.find_element(By.ID, "status").text == f"saved incorrect: {second}"

        third = shown_map_id(browser)
        press(browser, "s")
        wait.until(lambda d: shown_map_id(d) != third)
        browser.save_screenshot(SCREENSHOT)

    labels = open_audit_store(root).read_table("labels").to_pandas().set_index("id")
    assert set(labels.index) == {first, second}  # the skipped answer stays unlabelled
    assert labels.loc[first, "label"] == 1 and labels.loc[second, "label"] == 0
    assert (labels["source"] == "review").all()
    assert labels.loc[second, "correct_answer"] == "the right answer is rome"
    assert pd.isna(labels.loc[first, "correct_answer"])
