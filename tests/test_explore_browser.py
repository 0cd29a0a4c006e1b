"""`deriv explore` in a real browser: a person's keys and mouse on the page, the numbers the Python API gives.

Each folder of tests/data (the numbers language model and the numbers translation model) is served by its own
`deriv explore` child process (`deriv_lm.serving.client.ServerProcess`), and one headless Debian Chromium
(tests/chromium.py) opens the page afresh in each test. The page keeps every number as the server's float in data
attributes (`data-probability`, `data-row`, ...), so what it shows is compared exactly, not as parsed text. The
references are computed here, in this process, from the same folder: the tokenizer, `viz.attention.attention_maps`,
`compute.next_token`, and `generate()` itself.

Without Chromium, ChromeDriver or selenium the module skips with the reason, except under DERIV_REQUIRE_BROWSER=1
(CI's .ci/run exports it), where that is a failure. Without the serve extra (fastapi, uvicorn) it skips, as
tests/test_serve.py does. Screenshots go to a temporary folder, and to docs/images when DERIV_SCREENSHOTS=docs/images.
"""

import json
import os

import pytest
import torch


pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")

from browser import quit_chromium, require_browser, save_screenshots, screenshot_dirs, start_chromium  # noqa: E402


require_browser()

from selenium.webdriver import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from deriv_lm.serving.client import ServerProcess  # noqa: E402
from deriv_lm.viz.attention import attention_maps, load_eager  # noqa: E402
from deriv_lm.viz.explorer import compute  # noqa: E402


# drives Chromium against two explorer servers
pytestmark = pytest.mark.slow


DATA = os.path.join(os.path.dirname(__file__), "data")
LM = os.path.join(DATA, "numbers_lm")
EN = os.path.join(DATA, "numbers_en")
PROMPT = "5 3 1 8 : five thousand"  # the numbers model's prompt format: digits, " :", the number in words
QUESTION = "5 3 1 8 :"
UNSURE = "5 3"  # the model is unsure here (" :" or " " and a digit), so a temperature moves the probabilities
SOURCE = "5 3 1 8"
SECTIONS = ("tokens", "embeddings", "attention", "next-token", "generation")
WAIT = 60


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("explore-logs")
    started = {}
    try:
        for name, folder in (("lm", LM), ("en", EN)):
            started[name] = ServerProcess(folder, command="explore", log=logs / f"{name}.log")
        yield started
    finally:
        for server in started.values():
            assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium()
    yield driver
    quit_chromium(driver)


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return screenshot_dirs(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture(scope="module")
def lm_tokenizer():
    return AutoTokenizer.from_pretrained(LM)


# ---- driving the page ----------------------------------------------------------------------------------------


def settle(driver):
    """Until the page has no request in flight and none waiting out its typing pause."""
    WebDriverWait(driver, WAIT).until(lambda d: d.execute_script("return document.body.dataset.busy") == "0")


def open_page(driver, server):
    driver.get(server.url + "/")
    WebDriverWait(driver, WAIT).until(lambda d: d.find_element(By.ID, "folder-name").text)
    settle(driver)
    driver.get_log("browser")  # what the console said before this test's actions is not this test's


def replace_text(driver, element_id: str, text: str):
    """Select all of a field and type over it, as a person would."""
    field = driver.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE)
    field.send_keys(text)
    settle(driver)


def chips(driver, box="token-chips") -> list[dict]:
    return [
        {
            "id": int(c.get_attribute("data-token-id")),
            "raw": c.get_attribute("data-raw"),
            "piece": c.get_attribute("data-piece"),
        }
        for c in driver.find_elements(By.CSS_SELECTOR, f"#{box} .chip")
    ]


def candidates(driver) -> list[tuple[int, float]]:
    return [
        (int(c.get_attribute("data-token-id")), float(c.get_attribute("data-probability")))
        for c in driver.find_elements(By.CSS_SELECTOR, "#candidates .candidate")
    ]


def hovered_row(driver) -> list[float]:
    return json.loads(driver.find_element(By.ID, "attends").get_attribute("data-row"))


def console_errors(driver) -> list[str]:
    """The console's errors since the last look: a script error, or a CSP refusal of something the page used."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def canvas_pixel(driver, q: int, k: int) -> list[int]:
    """The RGBA at the middle of cell (q, k) of the attention map."""
    return driver.execute_script(
        """const canvas = document.getElementById("attention-map");
        const cell = canvas.clientWidth / Number(canvas.dataset.keys), ratio = canvas.width / canvas.clientWidth;
        const x = Math.floor((arguments[1] + 0.5) * cell * ratio), y = Math.floor((arguments[0] + 0.5) * cell * ratio);
        return Array.from(canvas.getContext("2d").getImageData(x, y, 1, 1).data);""",
        q,
        k,
    )


def settings_on_page(driver) -> dict:
    value = lambda element_id: driver.find_element(By.ID, element_id).get_attribute("value")  # noqa: E731
    return {
        "temperature": float(value("temperature")),
        "top_k": int(value("top-k")),
        "top_p": float(value("top-p")),
        "presence_penalty": float(value("presence-penalty")),
        "frequency_penalty": float(value("frequency-penalty")),
    }


# ---- the tests -----------------------------------------------------------------------------------------------


def test_typed_prompt_shows_the_folders_tokens_and_a_tokens_merges(chromium, servers, lm_tokenizer):
    open_page(chromium, servers["lm"])
    replace_text(chromium, "prompt", PROMPT)
    ids = lm_tokenizer(PROMPT, add_special_tokens=False).input_ids
    shown = chips(chromium)
    assert [c["id"] for c in shown] == ids
    assert [c["raw"] for c in shown] == lm_tokenizer.convert_ids_to_tokens(ids)
    assert [c["piece"] for c in shown] == [lm_tokenizer.decode([i]) for i in ids]
    # A merged token (the longest piece): its tree's root is that token, and its leaves spell it.
    longest = max(range(len(ids)), key=lambda i: len(shown[i]["raw"]))
    assert len(shown[longest]["raw"]) > 1, "no merged token in the prompt: the merge tree test proves nothing"
    chromium.find_elements(By.CSS_SELECTOR, "#token-chips .chip")[longest].click()
    settle(chromium)
    root = chromium.find_element(By.CSS_SELECTOR, "#merge-tree > .merge-node")
    assert root.get_attribute("data-raw") == shown[longest]["raw"]
    leaves = root.find_elements(By.CSS_SELECTOR, ".merge-node:not(:has(.merge-node))")
    assert "".join(leaf.get_attribute("data-raw") for leaf in leaves) == shown[longest]["raw"]
    assert chromium.find_element(By.ID, "error").text == ""
    assert console_errors(chromium) == []


def shown_map(driver) -> tuple[str, int, int]:
    canvas = driver.find_element(By.ID, "attention-map")
    return (
        canvas.get_attribute("data-kind"),
        int(canvas.get_attribute("data-layer")),
        int(canvas.get_attribute("data-head")),
    )


def hover_row(driver, row: int) -> list[float]:
    label = driver.find_element(By.CSS_SELECTOR, f'#row-labels [data-query-index="{row}"]')
    ActionChains(driver).move_to_element(label).perform()
    assert "active" in label.get_attribute("class")
    return hovered_row(driver)


def test_switching_layer_and_head_shows_that_map(chromium, servers, lm_tokenizer):
    open_page(chromium, servers["lm"])
    replace_text(chromium, "prompt", PROMPT)
    model, tokenizer = load_eager(LM)
    expected = attention_maps(model, tokenizer, PROMPT)["decoder"].weights
    layers, heads = expected.shape[:2]
    # Every layer and head at once: one thumbnail each, the shown one (layer 0, head 0 at first) outlined.
    thumbs = chromium.find_elements(By.CSS_SELECTOR, "#overview .thumb")
    assert len(thumbs) == layers * heads
    assert shown_map(chromium) == ("decoder", 0, 0)
    selected = chromium.find_elements(By.CSS_SELECTOR, "#overview .thumb.selected")
    assert [(t.get_attribute("data-layer"), t.get_attribute("data-head")) for t in selected] == [("0", "0")]
    # Through the selects: the server's float32 weights of that map, exactly.
    layer, head, row = 1, 2, 4
    Select(chromium.find_element(By.ID, "layer")).select_by_value(str(layer))
    settle(chromium)
    Select(chromium.find_element(By.ID, "head")).select_by_value(str(head))
    settle(chromium)
    assert shown_map(chromium) == ("decoder", layer, head)
    assert hover_row(chromium, row) == expected[layer, head, row].tolist()
    # Hovering a token's chip lists its row (of this layer and head) too.
    chip = chromium.find_elements(By.CSS_SELECTOR, "#token-chips .chip")[2]
    ActionChains(chromium).move_to_element(chip).perform()
    assert hovered_row(chromium) == expected[layer, head, 2].tolist()
    # The causal mask is drawn masked (the grey hatch, not a weight's blue); the diagonal is a weight's colour.
    r, g, b, _ = canvas_pixel(chromium, 0, len(expected[0, 0]) - 1)
    assert max(r, g, b) - min(r, g, b) <= 8 and r < 245, (r, g, b)
    r, g, b, _ = canvas_pixel(chromium, 0, 0)
    assert b - r > 40, (r, g, b)
    # By a click on a thumbnail: that map is shown, outlined, and the selects say which.
    chromium.find_element(By.CSS_SELECTOR, '#overview .thumb[data-layer="0"][data-head="3"]').click()
    settle(chromium)
    assert shown_map(chromium) == ("decoder", 0, 3)
    selects = [Select(chromium.find_element(By.ID, name)).first_selected_option.text for name in ("layer", "head")]
    assert selects == ["0", "3"]
    selected = chromium.find_elements(By.CSS_SELECTOR, "#overview .thumb.selected")
    assert [(t.get_attribute("data-layer"), t.get_attribute("data-head")) for t in selected] == [("0", "3")]
    assert hover_row(chromium, row) == expected[0, 3, row].tolist()
    # A new keystroke keeps the chosen map (analyze sends it as its view).
    chromium.find_element(By.ID, "prompt").send_keys(" ")
    settle(chromium)
    assert shown_map(chromium) == ("decoder", 0, 3)
    assert chromium.find_element(By.ID, "error").text == ""
    assert console_errors(chromium) == []


def test_temperature_keys_give_the_python_apis_probabilities(chromium, servers):
    open_page(chromium, servers["lm"])
    replace_text(chromium, "prompt", UNSURE)
    before = candidates(chromium)
    slider = chromium.find_element(By.ID, "temperature")
    start, step = float(slider.get_attribute("value")), float(slider.get_attribute("step"))
    for _ in range(3):
        slider.send_keys(Keys.ARROW_LEFT)
    settle(chromium)
    settings = settings_on_page(chromium)
    assert settings["temperature"] == pytest.approx(start - 3 * step)
    assert chromium.find_element(By.ID, "temperature-value").text == slider.get_attribute("value")
    after = candidates(chromium)
    assert after != before
    explorer = compute.Explorer.open(LM)
    expected = compute.next_token(explorer, {"text": UNSURE}, settings)["candidates"]
    assert after == [(c["id"], c["probability"]) for c in expected]  # the very floats
    # And independently: generate()'s own first-step scores, through its own processors.
    model = AutoModelForCausalLM.from_pretrained(LM).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(LM)(UNSURE, add_special_tokens=False).input_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=settings["temperature"],
        top_k=settings["top_k"],
        top_p=settings["top_p"],
        max_new_tokens=1,
        output_scores=True,
        return_dict_in_generate=True,
    )
    generated = torch.softmax(out.scores[0][0], dim=-1)
    for token_id, probability in after:
        assert probability == pytest.approx(generated[token_id].item(), abs=1e-6)
    # A penalty typed into its box is applied as compute applies it.
    replace_text(chromium, "presence-penalty", "0.5")
    settings = settings_on_page(chromium)
    assert settings["presence_penalty"] == 0.5
    expected = compute.next_token(explorer, {"text": UNSURE}, settings)
    assert candidates(chromium) == [(c["id"], c["probability"]) for c in expected["candidates"]]
    assert "PresencePenaltyLogitsProcessor(0.5)" in chromium.find_element(By.ID, "processors").text
    assert console_errors(chromium) == []


def test_greedy_three_steps_give_generates_tokens(chromium, servers, shots, lm_tokenizer):
    open_page(chromium, servers["lm"])
    replace_text(chromium, "prompt", QUESTION)
    replace_text(chromium, "steps", "3")
    chromium.find_element(By.ID, "greedy").click()
    WebDriverWait(chromium, WAIT).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#generation-table tbody tr")) == 3
    )
    settle(chromium)
    prompt = lm_tokenizer(QUESTION, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(LM).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=3,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(prompt) :]
    rows = chromium.find_elements(By.CSS_SELECTOR, "#generation-table tbody tr")
    assert [int(r.get_attribute("data-token-id")) for r in rows] == new.tolist()
    for row, scores, token in zip(rows, out.scores, new.tolist(), strict=True):
        chosen = torch.softmax(scores[0], dim=-1)[token].item()
        assert float(row.get_attribute("data-probability")) == pytest.approx(chosen, abs=1e-6)
    assert [r.get_attribute("data-phase") for r in rows] == ["prefill", "decode", "decode"]
    # The page re-analyzed the ids themselves: the prompt's tokens, then the three new ones.
    assert [c["id"] for c in chips(chromium)] == prompt + new.tolist()
    ActionChains(chromium).move_to_element(
        chromium.find_element(By.CSS_SELECTOR, "#token-chips .chip:nth-child(6)")
    ).perform()
    chromium.find_elements(By.CSS_SELECTOR, "#token-chips .chip")[-4].click()
    settle(chromium)
    assert console_errors(chromium) == []
    save_screenshots(chromium, "lm", shots, SECTIONS)


def test_translation_folder_shows_the_cross_attention_grid(chromium, servers, shots):
    open_page(chromium, servers["en"])
    assert chromium.find_element(By.ID, "target").is_displayed()
    replace_text(chromium, "prompt", SOURCE)
    model, tokenizer = load_eager(EN)
    maps = attention_maps(model, tokenizer, SOURCE)
    cross = maps["cross"]
    source = chips(chromium)
    target = chips(chromium, "target-chips")
    assert [c["id"] for c in source] == tokenizer(SOURCE, add_special_tokens=False).input_ids
    # The target is the model's own greedy translation, start token first, without the end-of-sequence token
    # that closed it (so that the next token's section shows where the model ends it).
    reference = AutoModelForSeq2SeqLM.from_pretrained(EN).eval()
    ids = torch.tensor([[c["id"] for c in source]])
    translation = reference.generate(ids, do_sample=False, num_beams=1, max_new_tokens=15)[0].tolist()
    assert translation[-1] == reference.generation_config.eos_token_id
    assert [c["id"] for c in target] == translation[:-1]
    assert shown_map(chromium) == ("cross", 0, 0)  # the alignment is shown first
    assert (
        len(chromium.find_elements(By.CSS_SELECTOR, "#overview .thumb"))
        == cross.weights.shape[0] * cross.weights.shape[1]
    )
    Select(chromium.find_element(By.ID, "attention-kind")).select_by_value("cross")
    Select(chromium.find_element(By.ID, "layer")).select_by_value("1")
    settle(chromium)
    canvas = chromium.find_element(By.ID, "attention-map")
    assert shown_map(chromium) == ("cross", 1, 0)
    assert int(canvas.get_attribute("data-queries")) == len(target)
    assert int(canvas.get_attribute("data-keys")) == len(source) == cross.weights.shape[3]
    assert len(chromium.find_elements(By.CSS_SELECTOR, "#row-labels .row-label")) == len(target)
    assert len(chromium.find_elements(By.CSS_SELECTOR, "#column-labels .col-label")) == len(source)
    assert canvas.size["width"] > 0 and canvas.size["height"] / canvas.size["width"] == pytest.approx(
        len(target) / len(source), rel=0.05
    )
    # The decoder is causal: this row's attention is the same with or without the tokens after it, up to float32
    # rounding (attention_maps' target has one token more: its closing </s>).
    row = 3
    ActionChains(chromium).move_to_element(
        chromium.find_elements(By.CSS_SELECTOR, "#target-chips .chip")[row]
    ).perform()
    assert hovered_row(chromium) == pytest.approx(cross.weights[1, 0, row].tolist(), abs=5e-6)
    # Another kind: its own maps, from the same forward (the source's self-attention: source x source).
    Select(chromium.find_element(By.ID, "attention-kind")).select_by_value("encoder")
    settle(chromium)
    assert shown_map(chromium) == ("encoder", 1, 0)
    assert int(canvas.get_attribute("data-queries")) == int(canvas.get_attribute("data-keys")) == len(source)
    assert chromium.find_element(By.ID, "overview").get_attribute("data-kind") == "encoder"
    Select(chromium.find_element(By.ID, "attention-kind")).select_by_value("cross")
    settle(chromium)
    assert shown_map(chromium) == ("cross", 1, 0)
    assert console_errors(chromium) == []
    save_screenshots(chromium, "translation", shots, ("tokens", "attention"))


def test_a_prompt_past_the_context_is_one_message_and_the_page_recovers(chromium, servers, lm_tokenizer):
    open_page(chromium, servers["lm"])
    replace_text(chromium, "prompt", "5 " * 100)  # 200 tokens; the model reads 64
    messages = chromium.find_elements(By.CSS_SELECTOR, "#error p")
    assert len(messages) == 1
    assert "this model reads at most 64" in messages[0].text
    replace_text(chromium, "prompt", PROMPT)
    assert chromium.find_elements(By.CSS_SELECTOR, "#error p") == []
    assert [c["id"] for c in chips(chromium)] == lm_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert candidates(chromium)


@pytest.fixture(scope="module")
def made_folders(tmp_path_factory):
    """The other folders a user opens, made as a user makes them: a GPT-2 checkpoint through `deriv import` (learned
    positions, pre-norm, no embedding scale) and the numbers model through `deriv quantize` (int8; the quantize
    extra, which the tested sets install)."""
    import importlib.util

    from test_tour import tiny_gpt2

    from deriv_lm.cli import main

    root = tmp_path_factory.mktemp("folders")
    folders = {"gpt2": root / "gpt2-deriv"}
    assert (
        main(
            ["import", tiny_gpt2(root / "hub-gpt2", AutoTokenizer.from_pretrained(LM)), "--out", str(folders["gpt2"])]
        )
        == 0
    )
    if importlib.util.find_spec("torchao") is not None:
        folders["int8"] = root / "numbers-int8"
        assert main(["quantize", LM, "--out", str(folders["int8"])]) == 0
    return folders


@pytest.mark.parametrize("kind", ["gpt2", "int8"])
def test_an_imported_gpt2_and_an_int8_folder_open_on_the_page(kind, chromium, made_folders, tmp_path):
    if kind not in made_folders:
        pytest.skip("torchao is not installed (the quantize extra)")
    folder = str(made_folders[kind])
    server = ServerProcess(folder, command="explore", log=tmp_path / "explore.log")
    try:
        open_page(chromium, server)
        replace_text(chromium, "prompt", PROMPT)
        explorer = compute.Explorer.open(folder)
        expected = compute.next_token(explorer, {"text": PROMPT}, settings_on_page(chromium))
        assert [c["id"] for c in chips(chromium)] == explorer.tokenizer(PROMPT, add_special_tokens=False).input_ids
        assert candidates(chromium) == [(c["id"], c["probability"]) for c in expected["candidates"]]
        equation = chromium.find_element(By.ID, "embedding-equation").text
        assert equation == ("x = E[t] + P[pos]" if kind == "gpt2" else "x = √d·E[t] + PE(pos)")
        assert ("(quantized)" in chromium.find_element(By.ID, "model-facts").text) == (kind == "int8")
        assert chromium.find_element(By.ID, "error").text == ""
        assert console_errors(chromium) == []
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_llama_shaped_folder_shows_its_kv_heads_and_no_position_strip(chromium, tmp_path):
    """Rotary positions add nothing to the first layer's input: the page draws the token and sum strips only and
    says where the positions went; the header names the kv heads, RMSNorm and SwiGLU."""
    import shutil

    from deriv_lm import DerivConfig, DerivForCausalLM

    folder = tmp_path / "llama-shaped"
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    shape.update(intermediate_size=96, max_position_embeddings=64, position_embedding_type="rotary", pre_norm=True)
    shape.update(norm_type="rms_norm", gated_mlp=True, hidden_act="silu", bias=False, scale_embedding=False)
    DerivForCausalLM(DerivConfig(**shape)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(LM, name), folder / name)
    server = ServerProcess(str(folder), command="explore", log=tmp_path / "explore.log")
    try:
        open_page(chromium, server)
        replace_text(chromium, "prompt", PROMPT)
        equation = chromium.find_element(By.ID, "embedding-equation").text
        assert equation == "x = E[t] (rotary: positions rotate q and k in each head)"
        strips = chromium.find_elements(By.CSS_SELECTOR, "#strips .strip-figure")
        assert [s.get_attribute("data-kind") for s in strips] == ["token", "sum"]
        assert "rotary: positions rotate q and k in each head" in chromium.find_element(By.ID, "embedding-note").text
        facts = chromium.find_element(By.ID, "model-facts").text
        assert "4 heads (2 key/value)" in facts and "(RMSNorm)" in facts and "SwiGLU" in facts and "no biases" in facts
        assert chromium.find_element(By.ID, "error").text == ""
        assert console_errors(chromium) == []
    finally:
        assert server.stop() == 0, server.log_tail()
