"""The playground page (``serving/playground/``, what ``attnzoo serve`` answers at ``/``) in headless
Chromium over a real server on loopback, with the tiny repository of every kind (``published``).

For each served kind the test fills the page's widget as a user would (types text, sets file inputs
to files written here, clicks points on the plane, draws with the mouse), waits for the answer, and
checks the picture against the answer the server gives this test for the same input: the heatmap's
cells are target × source pieces, the NTM's read-weights grid steps × memory slots, one overlay per
word or letter with the attention grid's size, one marker per glimpse... (DRAW draws from the page's own
noise: its canvases are counted and sized against the model's declared output). Each kind's panel is saved as
a screenshot in the test's tmp dir (and in $ATTNZOO_SCREENSHOTS when set). The page must make no
request beyond the server (the browser's own network log), and a bad input must show the server's
one-sentence error. Also: Triton's repository index (``POST /v2/repository/index``), the static
route's confinement to serving/playground/, and ``--no-playground``.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import playground_shot
import pytest
from PIL import Image

from models.neural_programmer import OPERATIONS
from tests.conftest import ROOT, tiny_batch
from tests.test_serving_production import start_server, stop

pytestmark = pytest.mark.integration  # starts servers or processes

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = "headless Chromium is missing: apt-get install chromium chromium-driver (scripts/setup.sh does)"


def fetch(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of one exchange, error statuses included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


@pytest.fixture(scope="module")
def srv(published):
    server = start_server(published.repo)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def page(srv, tmp_path_factory):
    """Headless Chromium on the playground page, with the browser's network and console logs."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(NO_BROWSER)  # a missing browser is a failure that names the fix, never a pass
    driver = playground_shot.browser()
    try:
        driver.set_page_load_timeout(30)
        driver.get(srv.url + "/")
        shots = tmp_path_factory.mktemp("screenshots")
        state = SimpleNamespace(driver=driver, url=srv.url, client=srv.client, shots=shots)
        wait(state, lambda: driver.find_elements("css selector", "#models a[data-model]"), "the model list")
        yield state
    finally:
        driver.quit()


# ---- driving the page ---------------------------------------------------------------------------------
def wait(page, predicate, what: str, timeout: float = 30):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(page.driver, timeout, poll_frequency=0.05).until(lambda _: predicate(), message=what)
    except TimeoutException:
        # what the page showed when it gave up, and its console's errors: enough to tell a slow
        # server from a failed request or a lost click when this fails only on a loaded machine
        seen = page.driver.execute_script("""const p = document.getElementById('panel');
            return {hash: location.hash, model: p && p.dataset.model, state: p && p.dataset.state,
                    status: p && p.querySelector('.status') && p.querySelector('.status').textContent};""")
        console = [e["message"] for e in page.driver.get_log("browser")]
        raise AssertionError(f"no {what} after {timeout} s; the page: {seen}; its console: {console}") from None


def panel(page):
    return page.driver.find_element("id", "panel")


def find(page, css: str):
    return panel(page).find_element("css selector", css)


def open_model(page, name: str, kind: str) -> None:
    page.driver.find_element("css selector", f'#models a[data-model="{name}"]').click()
    wait(page, lambda: panel(page).get_attribute("data-model") == name
         and panel(page).get_attribute("data-state") == "ready", f"the {name} panel")
    assert panel(page).get_attribute("data-kind") == kind


def fill(page, css: str, text: str) -> None:
    box = find(page, css)
    box.clear()
    box.send_keys(text)


def upload(page, path: Path, name: str = "image") -> None:
    find(page, f'input[type="file"][name="{name}"]').send_keys(str(path))
    wait(page, lambda: path.name in find(page, ".status").text, f"the page to read {path.name}")


def run(page, expect: str = "done") -> str:
    """Press the panel's run button; wait for the answer (or the error); the status line."""
    page.driver.execute_script("document.getElementById('panel').dataset.state = 'sent'")
    find(page, 'button[name="run"]').click()
    wait(page, lambda: panel(page).get_attribute("data-state") in ("done", "error"), "an answer")
    status = find(page, ".status").text
    assert panel(page).get_attribute("data-state") == expect, status
    return status


def result(page, name: str) -> str:
    return find(page, f'.result[data-result="{name}"]').text


def shown(text: str) -> str:
    """A text answer as the page shows it (an untrained tiny model may answer nothing)."""
    return text or "(empty)"


def heatmap(page, name: str) -> dict:
    """A drawn heatmap's declared rows and columns, its cells, and each cell's weight (its hover label)."""
    found = page.driver.execute_script("""
        const s = document.querySelector(`#panel svg.heatmap[data-name="${arguments[0]}"]`);
        if (!s) return null;
        const cells = [...s.querySelectorAll('rect.cell')];
        return {rows: +s.dataset.rows, cols: +s.dataset.cols, cells: cells.length,
                values: cells.map((c) => parseFloat(c.dataset.label.split(': ').pop()))};""", name)
    assert found is not None, f"no heatmap {name}"
    return found


def count(page, css: str) -> int:
    return len(panel(page).find_elements("css selector", css))


def attrs(page, css: str, attr: str) -> list[str]:
    return [e.get_attribute(attr) for e in panel(page).find_elements("css selector", css)]


def shoot(page, kind: str) -> None:
    """The panel as a PNG in the test's tmp dir, and in $ATTNZOO_SCREENSHOTS when set."""
    path = page.shots / f"{kind}.png"
    panel(page).screenshot(str(path))
    assert path.stat().st_size > 1000
    if os.environ.get("ATTNZOO_SCREENSHOTS"):
        dest = Path(os.environ["ATTNZOO_SCREENSHOTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest / path.name)


def png(path: Path, pixels: np.ndarray) -> np.ndarray:
    """Grey pixels in [0, 1] as an 8-bit PNG; the values the page will send (v / 255, float32)."""
    grey = np.round(np.clip(pixels, 0, 1) * 255).astype(np.uint8)
    Image.fromarray(grey, mode="L").save(path)
    return (grey / 255).astype(np.float32)


def close(drawn, expected) -> bool:
    """Weights read from the page (3 decimals) against the server's."""
    return np.allclose(np.asarray(drawn, dtype=float), np.asarray(expected, dtype=float).reshape(-1), atol=6e-4)


def server_error(page, name: str, body: dict) -> str:
    status, _, raw = fetch(f"{page.url}/v2/models/{name}/infer", "POST", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    assert status == 400
    return json.loads(raw)["error"]


# ---- each kind ----------------------------------------------------------------------------------------
def test_translation_shows_the_translation_the_nbest_list_and_the_alignment(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    open_model(page, "bahdanau", "translation")
    text = "Ich habe heute keine Zeit."
    fill(page, 'textarea[name="text"]', text)
    Select(find(page, 'select[name="decode"]')).select_by_value("beam")
    fill(page, 'input[name="beam"]', "3")
    fill(page, 'input[name="nbest"]', "2")
    run(page)
    ref = page.client.infer("bahdanau", {"text": [text]}, parameters={"decode": "beam", "beam": 3, "nbest": 2})
    assert result(page, "translation") == shown(ref["translation"][0])
    source = [p for p in ref["source_pieces"][0] if p]
    target = [p for p in ref["target_pieces"][0] if p]
    drawn = heatmap(page, "alignment")
    assert (drawn["rows"], drawn["cols"], drawn["cells"]) == (len(target), len(source), len(target) * len(source))
    assert close(drawn["values"], ref["attention"][0, : len(target), : len(source)])
    assert count(page, "ol.nbest li") == len([h for h in ref["nbest"][0] if h])
    cell = find(page, 'svg[data-name="alignment"] rect.cell[data-r="0"][data-c="0"]')
    ActionChains(page.driver).move_to_element(cell).perform()  # hover: the readout names the weight
    assert find(page, ".readout").text == cell.get_attribute("data-label")
    shoot(page, "translation")


def test_captioning_draws_each_words_attention_over_the_uploaded_image(page, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    open_model(page, "captioner", "image_caption")
    image = png(tmp_path / "scene.png", tiny_batch("show_attend_tell", seed=7, batch=1)["image"][0].numpy())
    upload(page, tmp_path / "scene.png")
    run(page)
    ref = page.client.infer("captioner", {"image": image[None]}, parameters={"decode": "beam"})
    assert result(page, "caption") == shown(ref["caption"][0])
    words = [w for w in ref["words"][0] if w]
    _, steps, h, w = ref["attention"].shape
    assert attrs(page, "figure.attn figcaption", "textContent") == words
    assert attrs(page, "canvas.overlay", "data-grid") == [f"{h}x{w}"] * len(words) and steps >= len(words)
    shoot(page, "image_caption")
    # and drawn with the mouse on the input canvas (white on black, as MNIST): answered too
    canvas = find(page, "canvas.input-image")
    ActionChains(page.driver).move_to_element_with_offset(canvas, -40, -40).click_and_hold() \
        .move_by_offset(60, 30).move_by_offset(20, 40).release().perform()
    run(page)
    assert count(page, "canvas.overlay") == count(page, "figure.attn") >= 1


def test_ram_marks_each_glimpse_on_the_uploaded_image(page, tmp_path):
    open_model(page, "ram", "glimpse")
    image = png(tmp_path / "digit.png", tiny_batch("ram", seed=4, batch=1)["image"][0].numpy())
    upload(page, tmp_path / "digit.png")
    run(page)
    ref = page.client.infer("ram", {"image": image[None]})
    assert result(page, "class") == f"class {ref['pred'][0]}"
    glimpses = ref["locations"].shape[1]
    assert attrs(page, "svg.glimpses", "data-glimpses") == [str(glimpses)]
    assert count(page, "svg.glimpses circle.glimpse") == glimpses
    assert count(page, 'svg[data-name="probabilities"] rect.bar') == ref["logits"].shape[1]
    shoot(page, "glimpse")


def test_ocr_draws_each_letters_attention_over_the_text_line(page, tmp_path):
    open_model(page, "ocr", "text_image")
    image = png(tmp_path / "word.png", tiny_batch("attention_ocr", seed=3, batch=1)["image"][0].numpy())
    upload(page, tmp_path / "word.png")
    run(page)
    ref = page.client.infer("ocr", {"image": image[None]}, parameters={"decode": "beam"})
    assert result(page, "text") == shown(ref["text"][0])
    letters = [c for c in ref["letters"][0] if c]
    _, _, h, w = ref["attention"].shape
    assert attrs(page, "figure.attn figcaption", "textContent") == letters
    assert attrs(page, "canvas.overlay", "data-grid") == [f"{h}x{w}"] * len(letters)
    shoot(page, "text_image")


def test_speech_shows_the_digits_and_the_alignment_over_time(page, tmp_path):
    with wave.open(str(ROOT / "examples" / "spoken_digits.wav")) as src:
        frames, rate = src.readframes(src.getnframes()), src.getframerate()
    with wave.open(str(tmp_path / "digits.wav"), "wb") as dst:  # 16 kHz mono 16-bit, as the model takes
        dst.setnchannels(1), dst.setsampwidth(2), dst.setframerate(rate)
        dst.writeframes(frames)
    audio = (np.frombuffer(frames, "<i2") / 32768).astype(np.float32)
    open_model(page, "speech", "audio")
    upload(page, tmp_path / "digits.wav", "audio")
    run(page)
    ref = page.client.infer("speech", {"audio": audio[None]}, parameters={"decode": "beam"})
    assert result(page, "text") == shown(ref["text"][0])
    _, steps, frames_out = ref["alignment"].shape
    drawn = heatmap(page, "alignment")
    assert (drawn["rows"], drawn["cols"], drawn["cells"]) == (steps, frames_out, steps * frames_out)
    assert close(drawn["values"], ref["alignment"][0])
    assert count(page, 'svg[data-name="alignment"] path.wave') == 1
    shoot(page, "audio")


def test_ntm_shows_the_output_bits_and_the_heads_weightings_over_memory(page, published):
    open_model(page, "ntm", "ntm")
    width = page.client.model_metadata("ntm")["inputs"][0]["shape"][2]
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 2, (3, width - 1))
    x = np.zeros((7, width), np.float32)  # 3 vectors, the delimiter, 3 blank steps
    x[:3, : width - 1], x[3, width - 1] = seq, 1
    fill(page, 'textarea[name="x"]', "\n".join("".join(str(int(v)) for v in row) for row in x))
    run(page)
    ref = page.client.infer("ntm", {"x": x[None]})
    assert close(heatmap(page, "output")["values"], ref["bits"][0])
    for name in ("read_weights", "write_weights"):
        _, steps, heads, slots = ref[name].shape
        for k in range(heads):
            drawn = heatmap(page, f"{name}-{k}")
            assert (drawn["rows"], drawn["cols"], drawn["cells"]) == (steps, slots, steps * slots)
            assert close(drawn["values"], ref[name][0, :, k])
    shoot(page, "ntm")


def test_draw_shows_the_canvas_after_each_step_with_its_write_window(page):
    open_model(page, "draw", "draw")
    fill(page, 'input[name="steps"]', "3")
    run(page)
    side = int(round(np.sqrt(page.client.model_metadata("draw")["outputs"][0]["shape"][-1])))
    assert attrs(page, "canvas.overlay", "data-side") == [str(side)] * 3
    assert attrs(page, "figure.attn figcaption", "textContent") == ["step 1", "step 2", "step 3"]
    shoot(page, "draw")


def test_pointer_network_orders_the_clicked_points_and_draws_its_attention(page):
    from selenium.webdriver.common.action_chains import ActionChains

    open_model(page, "pointer", "points")
    plane = find(page, 'svg[data-name="plane"]')
    for dx, dy in ((-100, -80), (90, -110), (120, 60), (-30, 120), (10, 5)):  # from the plane's centre
        ActionChains(page.driver).move_to_element_with_offset(plane, dx, dy).click().perform()
    assert count(page, "circle.point") == 5
    points = np.array([[float(v) for v in line.split()] for line in
                       find(page, 'textarea[name="points"]').get_attribute("value").split("\n")], np.float32)
    run(page)
    ref = page.client.infer("pointer", {"points": points[None]}, parameters={"decode": "greedy"})
    order = ref["pointers"][0, : ref["lengths"][0]].tolist()
    assert result(page, "order") == "order: " + " → ".join(map(str, order))
    drawn = heatmap(page, "pointers")
    assert (drawn["rows"], drawn["cols"]) == (len(order) + 1, len(points) + 1)
    assert close(drawn["values"], ref["attention"][0, : len(order) + 1])
    assert count(page, "circle.ring") == len(points)  # the first step's attention on the plane
    shoot(page, "points")


def test_act_shows_the_parity_and_each_ponder_steps_halting_probability(page):
    open_model(page, "act", "act")
    n = page.client.model_metadata("act")["inputs"][0]["shape"][1]
    x = np.resize(np.array([1, -1, 0, 1, 1, 0], np.float32), n)
    fill(page, 'input[name="x"]', " ".join(str(int(v)) for v in x))
    run(page)
    ref = page.client.infer("act", {"x": x[None]})
    assert result(page, "parity").startswith(f"parity {ref['bits'][0, 0]} · {ref['steps'][0]:.0f} ponder steps")
    assert count(page, 'svg[data-name="halting"] rect.bar') == ref["halting"].shape[1]
    assert count(page, 'svg[data-name="halting"] rect.bar:not(.off)') == min(int(ref["steps"][0]),
                                                                              ref["halting"].shape[1])
    shoot(page, "act")


def test_neural_programmer_answers_and_shows_each_steps_choice_and_the_servers_error(page):
    open_model(page, "programmer", "table_question")
    table = [[26, 98, 54], [73, 7, 72], [48, 35, 83]]
    fill(page, 'input[name="question"]', "sum age")
    fill(page, 'textarea[name="table"]', "height age year\n" + "\n".join(" ".join(map(str, r)) for r in table))
    run(page)
    body = {"question": ["sum age"], "columns": [["height", "age", "year"]], "table": np.array([table], np.float32)}
    ref = page.client.infer("programmer", body)
    shown = result(page, "answer")
    assert shown == ("answer: the highlighted cells" if ref["is_lookup"][0] else f"answer: {ref['answer'][0]:.2f}")
    assert count(page, "table.np td.picked") == int(ref["cells"][0].sum())
    _, steps, ops = ref["op_weights"].shape
    assert (heatmap(page, "operations")["rows"], heatmap(page, "operations")["cols"]) == (steps, ops)
    assert close(heatmap(page, "columns")["values"], ref["col_weights"][0])
    assert count(page, "ol.program li") == steps
    # each step names the operation the server's answer names, and the heatmap's columns are the names
    program = [e.text for e in panel(page).find_elements("css selector", "ol.program li")]
    assert [line.split(" (")[0] for line in program] == list(ref["operations"][0]), program
    labels = attrs(page, 'svg[data-name="operations"] rect.cell', "data-label")
    assert {label.split(" → ")[1].split(":")[0] for label in labels} == set(OPERATIONS), labels
    shoot(page, "table_question")
    # a word the model does not know: the page shows the server's own sentence
    fill(page, 'input[name="question"]', "sum banana")
    status = run(page, expect="error")
    expected = server_error(page, "programmer", {"inputs": [
        {"name": "question", "datatype": "BYTES", "shape": [1], "data": ["sum banana"]},
        {"name": "columns", "datatype": "BYTES", "shape": [1, 3], "data": ["height", "age", "year"]},
        {"name": "table", "datatype": "FP32", "shape": [1, 3, 3], "data": sum(table, [])}]})
    assert status == expected and "banana" in status


def test_the_page_lists_every_served_model_and_asked_nothing_of_any_other_origin(page, srv):
    open_model(page, "act", "act")  # at least one answer, when this test runs alone
    run(page)
    listed = {e.get_attribute("data-model") for e in page.driver.find_elements("css selector", "#models a")}
    index = json.loads(fetch(srv.url + "/v2/repository/index", "POST", b"{}")[2])
    whole = {m["name"] for m in index if "." not in m["name"]}
    assert listed == whole
    page.driver.find_element("id", "show-graphs").click()  # the single graphs too
    assert {e.get_attribute("data-model") for e in page.driver.find_elements("css selector", "#models a")} == \
        {m["name"] for m in index}
    origin = srv.url  # http://127.0.0.1:PORT
    requested = []
    for entry in page.driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requested.append(message["params"]["request"]["url"])
    assert any(u.endswith("/infer") for u in requested) and any(u == origin + "/" for u in requested)
    elsewhere = [u for u in requested if not u.startswith(origin + "/") and not u.startswith(("data:", "blob:"))]
    assert not elsewhere, elsewhere
    resources = page.driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    assert resources and all(u.startswith(origin + "/") for u in resources), resources
    # no script error and no Content-Security-Policy violation; the one 400 is the bad question's
    severe = [e["message"] for e in page.driver.get_log("browser") if e["level"] == "SEVERE"]
    assert all("status of 400" in m for m in severe), severe


# ---- the server side: the repository index, the static files, --no-playground -----------------------------
def test_repository_index_lists_every_served_model_and_version(srv, published):
    meta = srv.client.server_metadata()
    assert meta["extensions"] == ["binary_tensor_data", "model_repository"]
    entries = []
    # JSON, or whatever Content-Type the client says (curl -d says form data, as urllib does here)
    for body, kind in ((b"{}", "application/json"), (b'{"ready": true}', "application/json"),
                       (b'{"ready": false}', None), (b"", None)):
        status, headers, raw = fetch(srv.url + "/v2/repository/index", "POST", body,
                                     {"Content-Type": kind} if kind else {})
        assert status == 200 and headers["content-type"] == "application/json", raw
        entries.append(json.loads(raw))
    assert entries[0] == entries[1] == entries[2] == entries[3]
    index = entries[0]
    assert all(set(e) == {"name", "version", "state"} and e["state"] == "READY" for e in index)
    assert [(e["name"], e["version"]) for e in index if e["name"] == "ntm"] == [("ntm", "1"), ("ntm", "2")]
    for e in index:  # each one answers its metadata
        assert e["version"] in srv.client.model_metadata(e["name"])["versions"]
    assert {"bahdanau", "bahdanau.encoder", "captioner", "speech", "programmer", "act"} <= {e["name"] for e in index}
    for bad, why in ((b'{"ready": "yes"}', "valid boolean at ready"), (b"[]", "object"), (b"{", "JSON")):
        status, _, raw = fetch(srv.url + "/v2/repository/index", "POST", bad, {"Content-Type": "application/json"})
        assert status == 400 and why in json.loads(raw)["error"], raw
    doc = json.loads(fetch(srv.url + "/openapi.json")[2])
    assert doc["paths"]["/v2/repository/index"]["post"]["requestBody"]["content"]["application/json"]
    assert doc["components"]["schemas"]["RepositoryIndexRequest"]["properties"]["ready"]


def test_the_page_is_served_from_serving_playground_only(srv):
    status, headers, body = fetch(srv.url + "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"playground/app.js" in body
    assert "default-src 'self'" in headers["content-security-policy"]
    for name, media in (("app.js", "text/javascript"), ("style.css", "text/css")):
        status, headers, body = fetch(f"{srv.url}/playground/{name}")
        assert status == 200 and headers["content-type"].startswith(media)
        assert body == (ROOT / "serving" / "playground" / name).read_bytes()
    for path in ("/playground/server.py", "/playground/..%2Fserver.py", "/playground/%2e%2e%2f__init__.py",
                 "/playground/../server.py", "/playground/", "/playground/index.html/x", "/serving/server.py"):
        status, _, body = fetch(srv.url + path)
        assert status == 404 and b"import" not in body, path
    assert "/" not in json.loads(fetch(srv.url + "/openapi.json")[2])["paths"]  # not part of the API


def test_no_playground_turns_the_page_off(published):
    server = start_server(published.repo, "--no-playground")
    try:
        assert fetch(server.url + "/")[0] == 404
        assert fetch(server.url + "/playground/app.js")[0] == 404
        assert fetch(server.url + "/v2/repository/index", "POST", b"{}")[0] == 200
    finally:
        stop(server)


def test_the_screenshot_script_saves_a_models_answered_panel(published, tmp_path):
    """scripts/playground_shot.py (the README's screenshot) on the tiny repository's Neural Programmer."""
    out = tmp_path / "shot.png"
    example = {"question": ["sum age"], "columns": [["height", "age", "year"]], "table": [[[26, 98, 54], [73, 7, 72]]]}
    playground_shot.shoot(published.repo, "programmer", example, out)
    assert Image.open(out).size[0] > 600
