"""Issue 31, fast failure and quiet output: a bad path is refused before torch or transformers is imported,
`import deriv_lm` imports neither (and still registers the models once transformers' Auto classes are used),
and a normal command prints nothing of the libraries' own on stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
NUMBERS_LM = ROOT / "tests" / "data" / "numbers_lm"

# Runs the console script's main in-process, then says on the last line of stderr which libraries it imported.
PROBE = """
import json, sys
import deriv_lm_cli
try:
    code = deriv_lm_cli.main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}),
      file=sys.stderr)
"""


def probe(*argv: str, cwd=ROOT) -> tuple[dict, list[str]]:
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd, timeout=600)
    lines = result.stderr.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "/nonexistent", "x"],
        ["chat", "/nonexistent"],
        ["translate", "/nonexistent", "x"],
        ["serve", "/nonexistent"],
        ["attention", "/nonexistent", "x"],
        ["export", "/nonexistent", "--to", "gpt2", "--out", "/tmp/never-written"],
        ["quantize", "/nonexistent", "--out", "/tmp/never-written"],
        ["import", "/nonexistent", "--out", "/tmp/never-written"],
        ["tokenizer", "show", "/nonexistent", "x"],
        ["eval", "/nonexistent"],
        ["check", "/nonexistent"],
        ["card", "/nonexistent"],
        ["train", "lm", "--files", "/nonexistent.txt"],
        ["train", "lm", "--files=/nonexistent/*.txt"],
        ["train", "lm", "--init-from", "/nonexistent"],
        ["train", "translation", "--files", str(ROOT / "README.md"), "/nonexistent.tsv"],
        ["train", "sft", "--init-from=/nonexistent"],
        ["train", "lm", "--tokenizer", "/nonexistent"],
    ],
    ids=lambda argv: " ".join(argv[:3]),
)
def test_a_missing_folder_is_refused_in_one_line_before_torch_is_imported(argv):
    outcome, lines = probe(*argv)
    assert outcome["code"] == 2
    assert len(lines) == 1 and lines[0].startswith("deriv: error: ") and "/nonexistent" in lines[0], lines
    assert not outcome["torch"] and not outcome["transformers"]


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path):
    outcome, lines = probe("generate", str(tmp_path), "x")
    assert outcome["code"] == 2 and not outcome["torch"]
    assert lines == [
        f"deriv: error: argument folder: {tmp_path} is not a model folder: it has no config.json "
        "(see `deriv generate --help`)"
    ]


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_import_deriv_lm_imports_neither_torch_nor_transformers():
    assert run_python("import sys, deriv_lm; print('torch' in sys.modules, 'transformers' in sys.modules)") == (
        "False False"
    )


@pytest.mark.slow
@pytest.mark.upstream
def test_a_deriv_class_loads_without_transformers_pipelines():
    code = "import sys; from deriv_lm import DerivConfig; print('transformers.pipelines' in sys.modules)"
    assert run_python(code) == "False"


@pytest.mark.slow
@pytest.mark.upstream
def test_import_deriv_lm_still_registers_the_models_with_the_auto_classes():
    code = f"""
import deriv_lm
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(NUMBERS_LM)!r})
print(type(model).__name__)
"""
    assert run_python(code).splitlines()[-1] == "DerivForCausalLM"


@pytest.mark.parametrize("order", ["pipelines first", "deriv_lm first", "pipeline module first"])
@pytest.mark.slow
@pytest.mark.upstream
def test_the_translation_pipeline_is_registered_whatever_the_import_order(order):
    imports = {
        "pipelines first": "import transformers.pipelines\nimport deriv_lm",
        "deriv_lm first": "import deriv_lm\nfrom transformers import pipeline",
        "pipeline module first": "from deriv_lm.modeling_deriv.pipeline_deriv import DerivTranslationPipeline",
    }[order]
    code = f"""
{imports}
from transformers.pipelines import PIPELINE_REGISTRY
print(PIPELINE_REGISTRY.supported_tasks["deriv-translation"]["impl"].__name__)
"""
    assert run_python(code).splitlines()[-1] == "DerivTranslationPipeline"


@pytest.mark.slow
def test_a_bare_generate_prints_nothing_on_stderr():
    result = subprocess.run(
        [sys.executable, "-m", "deriv_lm.cli", "generate", str(NUMBERS_LM), "one two", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    assert result.stderr == ""


# What `deriv` sets (setdefault) to quiet the libraries; an in-process `main()` earlier in the session leaves them
# in this process's environment, which a child would inherit as if the user had set them.
QUIET = ("TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS")
FRESH_ENV = {k: v for k, v in os.environ.items() if k not in QUIET + ("HF_DATASETS_DISABLE_PROGRESS_BARS",)}


@pytest.mark.slow
def test_verbose_keeps_the_libraries_progress_bars():
    # what transformers itself prints loading the folder, outside deriv's command (transformers 5.23 has no bar)
    own = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import deriv_lm; from transformers import AutoModelForCausalLM; "
            f"AutoModelForCausalLM.from_pretrained({str(NUMBERS_LM)!r})",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=FRESH_ENV,
    )
    assert own.returncode == 0, own.stderr[-3000:]
    if "Loading weights" not in own.stderr:
        pytest.skip("this transformers draws no loading bar to keep")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deriv_lm.cli",
            "--verbose",
            "generate",
            str(NUMBERS_LM),
            "one",
            "--max-new-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=FRESH_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading weights" in result.stderr


def test_continuous_batching_drops_the_repetition_penalty_once_at_start(caplog):
    from transformers import GenerationConfig

    from deriv_lm.serving.engines import without_unsupported_settings

    folder_config = GenerationConfig.from_pretrained(NUMBERS_LM)
    assert folder_config.repetition_penalty == 1.1  # the folders' own setting, which CB would warn about
    with caplog.at_level("WARNING", logger="deriv_lm.serve"):
        served = without_unsupported_settings(folder_config)
    assert served.repetition_penalty is None and folder_config.repetition_penalty == 1.1
    assert served.temperature == folder_config.temperature and served.top_p == folder_config.top_p
    assert [r.getMessage() for r in caplog.records if "repetition_penalty=1.1" in r.getMessage()] != []
