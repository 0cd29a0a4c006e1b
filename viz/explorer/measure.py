"""How long a person waits on the explorer's page: from a keystroke to the page redrawn, in headless Chromium.

    python -m deriv_lm.viz.explorer.measure runs/deriv-tiny runs/deriv-small --repeats 7

For each folder, `deriv explore` starts in a child process and the page opens in a headless Chromium (Debian's,
driven through Selenium: `viz/explorer/browser.py`). Then, for a short prompt and for one that fills the context
but for the characters to come, a character is typed `repeats` times and the page's own clock is read once the
reply is drawn (`#status[data-keystroke-ms]`: the last keystroke, the page's 150 ms pause for more typing, the
round trip, and the drawing of the tokens, embeddings, one attention map with the overview of every head, and
the distribution); likewise one step of the temperature control, which recomputes the distribution only, and a
switch of head (one map, looked up among the server's last forwards). Prints medians, with the server's own
compute time and the size of the page's files and of the analyze reply.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path


STATIC = Path(__file__).parent / "static"
SHORT = "Return the absolute value of a"
FILLER = "Return the absolute value of a number, and the rest of the text as it was. "
WAIT = 300


def page_bytes() -> dict[str, int]:
    return {path.name: path.stat().st_size for path in sorted(STATIC.iterdir())}


def long_prompt(folder: str, spare: int) -> str:
    """A prompt of the folder's context less `spare` tokens (room for the characters typed)."""
    from ...folder.load import load_folder

    loaded = load_folder(folder)
    context = loaded.model.config.max_position_embeddings
    ids = loaded.tokenizer(FILLER * context, add_special_tokens=False).input_ids[: context - spare]
    return loaded.tokenizer.decode(ids)


def reply_bytes(url: str, text: str) -> int:
    request = urllib.request.Request(
        f"{url}/api/analyze", json.dumps({"text": text}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=WAIT) as reply:
        return len(reply.read())


def drawn(driver) -> dict:
    """Waits until the page has drawn the reply to the last keystroke; its clock's readings, in ms."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        status = driver.execute_script(
            "const s = document.getElementById('status').dataset, e = document.getElementById('error');"
            "return [document.body.dataset.busy, s.keystrokeMs, s.ms, s.serverMs, e.textContent];"
        )
        busy, keystroke, round_trip, server, error = status
        if error:
            raise RuntimeError(f"the page shows an error: {error}")
        if busy == "0" and keystroke:
            return {"keystroke": float(keystroke), "round_trip": float(round_trip), "server": float(server or "nan")}
        time.sleep(0.01)
    raise TimeoutError(f"the page did not draw within {WAIT} s")


def clear_clock(driver) -> None:
    driver.execute_script("delete document.getElementById('status').dataset.keystrokeMs")


def type_and_time(driver, element, keys: str) -> dict:
    clear_clock(driver)
    element.send_keys(keys)
    return drawn(driver)


def measure_folder(folder: str, repeats: int) -> list[dict]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from ...serving.client import ServerProcess
    from .browser import quit_chromium, start_chromium

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        server = ServerProcess(folder, command="explore", log=Path(scratch) / "explore.log")
        driver = start_chromium()
        try:
            driver.get(server.url + "/")
            prompt = driver.find_element(By.ID, "prompt")
            spare = repeats + 3  # room for the characters typed, a token each at worst
            for name, text in (("short prompt", SHORT), (f"context less {spare} tokens", long_prompt(folder, spare))):
                driver.execute_script("arguments[0].value = arguments[1]", prompt, text[:-1])
                type_and_time(driver, prompt, text[-1])  # the first analyze of this prompt, not counted
                typed = [type_and_time(driver, prompt, key) for key in "xy" * (repeats // 2) + "x" * (repeats % 2)]
                tokens = len(driver.find_elements(By.CSS_SELECTOR, "#token-chips .chip"))
                rows.append(row(folder, f"type a character ({name}, {tokens} tokens)", typed))
                rows[-1]["reply_bytes"] = reply_bytes(server.url, text)
                head = driver.find_element(By.ID, "head")  # keys on a focused select change it, as a person's do
                switched = [type_and_time(driver, head, key) for key in (Keys.ARROW_DOWN, Keys.ARROW_UP) * repeats]
                rows.append(row(folder, f"switch the head ({name})", switched[:repeats]))
                slider = driver.find_element(By.ID, "temperature")
                moved = [type_and_time(driver, slider, key) for key in (Keys.ARROW_LEFT, Keys.ARROW_RIGHT) * repeats]
                rows.append(row(folder, f"move the temperature ({name})", moved[:repeats]))
        finally:
            quit_chromium(driver)
            server.stop()
    return rows


def row(folder: str, what: str, readings: list[dict]) -> dict:
    def median(key):
        return statistics.median(r[key] for r in readings)

    return {
        "folder": Path(folder).name,
        "what": what,
        "n": len(readings),
        "keystroke_ms": median("keystroke"),
        "round_trip_ms": median("round_trip"),
        "server_ms": median("server"),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| folder | what | n | keystroke to page (ms, median) | round trip (ms) | model (ms) | analyze reply "
        "(bytes) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        server = "" if r["server_ms"] != r["server_ms"] else f"{r['server_ms']:.0f}"  # nan: /api/next sends none
        size = f"{r['reply_bytes']:,}" if "reply_bytes" in r else ""
        lines.append(
            f"| {r['folder']} | {r['what']} | {r['n']} | {r['keystroke_ms']:.0f} | {r['round_trip_ms']:.0f} | "
            f"{server} | {size} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--repeats", type=int, default=7)
    ns = parser.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()  # the long prompt is cut to the context after it is tokenized whole
    rows = [r for folder in ns.folders for r in measure_folder(folder, ns.repeats)]
    print(table(rows))
    files = page_bytes()
    print(f"\nthe page: {sum(files.values()):,} bytes ({', '.join(f'{k} {v:,}' for k, v in files.items())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
