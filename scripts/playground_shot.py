"""A screenshot of the server's playground page answering one model from a model repository.

    python scripts/playground_shot.py --repository model_repository --model neural_programmer \
        --input examples/table_qa.json --out docs/images/playground_neural_programmer.png

Starts ``attnzoo serve`` on 127.0.0.1, opens the page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which scripts/setup.sh installs; Selenium), picks the model, fills its widget
from an examples/ file, runs it and saves the panel. The README's screenshot is made this way from
the repository ``dvc repro publish@neural_programmer`` writes. Supported inputs: the table-QA
example (a question and a table) and translation text files; other kinds: tests/test_playground.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import cli_errors

ROOT = Path(__file__).resolve().parent.parent
CHROME_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1600",
               "--force-device-scale-factor=1", "--hide-scrollbars", "--no-first-run", "--disable-default-apps",
               "--disable-background-networking", "--disable-component-update", "--disable-sync", "--mute-audio")


def browser():
    """Headless Chromium under Selenium, logging its network and console (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise cli_errors.ScriptError("headless Chromium is missing: apt-get install chromium chromium-driver "
                                     "(scripts/setup.sh does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


@contextmanager
def server(repository: Path):
    """``attnzoo serve`` on a free loopback port; yields its URL once it is ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repository), "--port",
                             str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # 60 s at most
            try:
                urllib.request.urlopen(url + "/v2/health/ready", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise cli_errors.ScriptError(f"the server stopped (exit {proc.returncode}); is {repository} a "
                                                 "model repository?") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def fill_and_run(driver, example: dict) -> None:
    """The table-QA widget from an examples/table_qa.json request, or the translation text box."""
    panel = driver.find_element("id", "panel")
    if "question" in example:
        header = " ".join(example["columns"][0])
        rows = "\n".join(" ".join(f"{v:g}" for v in row) for row in example["table"][0])
        fields = {'input[name="question"]': example["question"][0], 'textarea[name="table"]': f"{header}\n{rows}"}
    else:
        fields = {"textarea": example["text"]}
    for css, text in fields.items():
        box = panel.find_element("css selector", css)
        box.clear()
        box.send_keys(text)
    panel.find_element("css selector", 'button[name="run"]').click()


def shoot(repository: Path, model: str, example: dict, out: Path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    with server(repository) as url:
        driver = browser()
        try:
            driver.get(url + "/")
            until = WebDriverWait(driver, 60, poll_frequency=0.05).until
            until(lambda d: d.find_elements("css selector", f'#models a[data-model="{model}"]'), "the model list")
            driver.find_element("css selector", f'#models a[data-model="{model}"]').click()
            panel = lambda d: d.find_element("id", "panel")  # noqa: E731
            until(lambda d: panel(d).get_attribute("data-state") == "ready", f"the {model} panel")
            fill_and_run(driver, example)
            until(lambda d: panel(d).get_attribute("data-state") in ("done", "error"), "the answer")
            if panel(driver).get_attribute("data-state") == "error":
                raise SystemExit(f"error: the page shows the server's error: {panel(driver).text[:300]}")
            out.parent.mkdir(parents=True, exist_ok=True)
            panel(driver).screenshot(str(out))
        finally:
            driver.quit()


def read_example(path: Path) -> dict:
    """``--input``: examples/table_qa.json's request, or the first line of a text file."""
    if not path.is_file():
        raise cli_errors.ScriptError(f"--input {path}: no such file")
    text = path.read_text()
    example = json.loads(text) if path.suffix == ".json" else {"text": (text.splitlines() or [""])[0]}
    if "question" not in example and "text" not in example:
        raise cli_errors.ScriptError(f"--input {path}: the page is filled from examples/table_qa.json or a text "
                                     "file of one sentence, not this example")
    return example


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Screenshot the playground page answering one model.")
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--model", default="neural_programmer")
    ap.add_argument("--input", type=Path, default=ROOT / "examples" / "table_qa.json",
                    help="examples/table_qa.json, or a text file of one sentence for a translation model")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    example = read_example(args.input)
    cli_errors.need_module("selenium")
    if not (args.repository / args.model).is_dir():
        raise cli_errors.ScriptError(f"{args.repository / args.model}: {args.model} is not published there; run "
                                     f"`attnzoo repro publish@{args.model}` or pass --repository DIR")
    shoot(args.repository, args.model, example, args.out)
    print(f"{args.out}: the {args.model} panel")


if __name__ == "__main__":
    cli_errors.run(main)
