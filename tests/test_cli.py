"""The `qkvshare` entry point, the extras, the packaging metadata and CI.

- Help, version and unknown commands import neither torch nor transformers (fresh interpreters, `sys.modules`);
  every command's `--help` and bad arguments are answered without importing the `qkvshare` package at all.
- A command's arguments are parsed once, by its parser in `qkvshare_settings`, and handed to the command's library
  function (a throwaway command in tmp_path records its parses, its runs and which package `__init__` ran); what
  that function raises is the exit status.
- A missing extra is reported once, naming the package and the `pip install` line, exit status 2, before the
  command runs (simulated with `sys.modules[name] = None`).
- pyproject's extras match `qkvshare_settings.extras.EXTRAS`, every third-party import of the package is declared, the
  model files need only the core, `qkvshare_cli` and `qkvshare_settings` need only the standard library and
  PyYAML, the packages ship,
  one version source, `.ci/run` fails when a step fails.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import qkvshare_cli
from qkvshare_cli import COMMANDS, Command, extras
from qkvshare_settings.extras import EXTRAS, MissingExtraError, check_extra, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MODEL_FILES = (
    "configuration_qkvshare",
    "modeling_qkvshare",
    "cache_qkvshare",
    "linear_attention_qkvshare",
    "compat_qkvshare",
)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
_DRIVER = """
import contextlib, io, json, sys
for name in {blocked!r}:
    sys.modules[name] = None  # simulate a package that is not installed
import qkvshare_cli
calls = []
for argv in {argvs!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = qkvshare_cli.main(argv)
    calls.append({{"code": code, "out": out.getvalue(), "err": err.getvalue()}})
loaded = [m for m in ("torch", "transformers", "lm_eval", "accelerate") if sys.modules.get(m) is not None]
left = sorted(m for m in sys.modules if m == "qkvshare" or m.startswith("qkvshare."))
print(json.dumps({{"calls": calls, "loaded": loaded, "qkvshare_modules": left}}))
"""


def run_fresh(*argvs: list[str], blocked: tuple[str, ...] = ()) -> dict:
    """Call `qkvshare_cli.main(argv)` for each argv in one new interpreter; report outputs and loaded modules."""
    code = _DRIVER.format(argvs=list(argvs), blocked=list(blocked))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_command(tmp_path, monkeypatch):
    """A `demo` command: its parser in the module `demoargs`, the command in a package `democmd` whose `__init__`s
    log that they ran. `demolog` records every parse, every run (with the arguments it got) and every init."""
    write_package(
        tmp_path,
        {
            "demolog.py": "inits = []\nparses = []\nruns = []\n",
            "demoargs.py": """
                import argparse
                import demolog

                def parse_args(argv):
                    demolog.parses.append(list(argv))
                    parser = argparse.ArgumentParser(prog="qkvshare demo")
                    parser.add_argument("--n", type=int, default=0)
                    for flag in ("--plot", "--broken", "--require"):
                        parser.add_argument(flag, action="store_true")
                    args = parser.parse_args(argv)
                    if args.n < 0:
                        raise ValueError(f"--n must be >= 0, got {args.n}")
                    return args
                """,
            "democmd/__init__.py": "import demolog\ndemolog.inits.append(__name__)\n",
            "democmd/sub/__init__.py": "import demolog\ndemolog.inits.append(__name__)\n",
            "democmd/sub/run.py": """
                import demolog

                from qkvshare_settings.conventions import CommandStopped

                class Stopped(CommandStopped):
                    exit_status = 3

                def execute(args):
                    demolog.runs.append(args)
                    if args.plot:
                        import matplotlib  # a raw optional import deep inside a command
                    if args.broken:
                        import no_such_module_anywhere  # not an extra: a bug, keeps its traceback
                    if args.require:
                        from qkvshare_settings.extras import require
                        require("matplotlib.pyplot", "plots", "the demo plot", hint="or pass --no_plot")
                    if args.n == 3:
                        raise Stopped("stopped at 3")
                """,
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    command = Command("demoargs:parse_args", "democmd.sub.run:execute", "a demo")
    monkeypatch.setitem(COMMANDS, "demo", command)
    yield command
    for name in [m for m in sys.modules if m in ("demolog", "demoargs") or m.split(".")[0] == "democmd"]:
        del sys.modules[name]


def plots_message(feature: str, hint: str = "") -> str:
    return (
        f"The package matplotlib, needed by {feature}, is not installed. Install the 'plots' extra: "
        'pip install "qkvshare[plots]" (in a source checkout: pip install -e ".[plots]")'
        + (f"; {hint}" if hint else "")
        + "."
    )


# ---------------------------------------------------------------------------------------------------------------
# item 5: help, version and unknown commands without torch
# ---------------------------------------------------------------------------------------------------------------
def test_help_version_and_unknown_command_import_neither_torch_nor_transformers():
    from qkvshare.version import __version__

    report = run_fresh(["--help"], ["--version"], ["trian"], [])
    helped, version, unknown, empty = report["calls"]
    assert helped["code"] == 0 and helped["err"] == ""
    for name, command in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(command.help)}", helped["out"], re.M), name
    assert version == {"code": 0, "out": f"qkvshare {__version__}\n", "err": ""}
    assert unknown["code"] == 2 and unknown["out"] == ""
    assert unknown["err"].startswith("qkvshare: unknown command 'trian'. Did you mean 'train'?")
    assert empty["code"] == 2 and "usage: qkvshare <command>" in empty["err"]
    assert report["loaded"] == []
    assert report["qkvshare_modules"] == []  # the package (torch, transformers) is never imported


def test_commands_hide_only_the_known_harmless_log_lines_of_torchao():
    """transformers imports torchao when it is installed (a [dev] or [export] install): its "Failed to load
    ..._C....so" lines and torch's pytree Enum notice are dropped by the command; other records still show."""
    import logging

    from qkvshare_cli.quiet import KNOWN_HARMLESS, hide_known_harmless_logs

    hide_known_harmless_logs()
    hide_known_harmless_logs()  # idempotent: one filter per logger
    so = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    cases = [
        ("torchao", f"Failed to load {so}: Could not load this library: {so}", False),
        ("torchao", "Skipping import of cpp extensions due to incompatible torch version.", True),
        ("torchao", "Failed to load /data/my_model.so: not torchao's", True),
        ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile as an "
         "opaque value type. Calling register_constant() on Enum subclasses is deprecated", False),
        ("torch.utils._pytree", "another pytree warning", True),
        ("accelerate.utils.other", "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be "
         "OK, but check by verifying that you don't receive any warning while reloading", False),
        ("accelerate.utils.other", "[RANK 0] Removed shared tensor {'model.layers.0.mlp.up_proj.weight'} while "
         "saving.", True),
    ]  # fmt: skip
    for name, message, shown in cases:
        logger = logging.getLogger(name)
        args = ("<enum 'KernelPreference'>",) if "%s" in message else ()
        record = logger.makeRecord(name, logging.WARNING, "x.py", 1, message, args, None)
        assert logger.filter(record) is shown, message
    assert all(len(logging.getLogger(name).filters) == 1 for name in KNOWN_HARMLESS)

    # A command in a fresh interpreter, against `import qkvshare` alone (which prints the lines in this install).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    plain = subprocess.run([sys.executable, "-c", "import qkvshare"], env=env, capture_output=True, text=True)
    known = [line for line in plain.stderr.splitlines() if any(p.search(line) for p in KNOWN_HARMLESS.values())]
    if not known:
        pytest.skip("this install prints none of the known lines (no torchao, or its kernels load here)")
    code = "import sys, qkvshare_cli; sys.exit(qkvshare_cli.main(['costs', '--preset', 'tiny']))"
    command = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert command.returncode == 0 and "| QKV |" in command.stdout
    assert command.stderr == ""


def test_console_script_and_its_packages_ship():
    from setuptools import find_namespace_packages

    assert PYPROJECT["project"]["scripts"] == {"qkvshare": "qkvshare_cli:main"}
    found = find_namespace_packages(str(ROOT), include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    subpackages = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in ROOT.glob("qkvshare/**/*.py")}
    assert {"qkvshare_cli", "qkvshare_settings", *subpackages} <= set(found)  # the wheel holds the CLI's packages


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_help_without_torch(name):
    report = run_fresh([name, "--help"])
    (helped,) = report["calls"]
    assert helped["code"] == 0, helped["err"]
    assert helped["out"].startswith(f"usage: qkvshare {name}")
    assert "torch" not in report["loaded"]
    assert report["qkvshare_modules"] == []


def test_train_bad_input_answered_before_torch(tmp_path):
    missing = tmp_path / "missing.yaml"
    report = run_fresh(
        ["train", str(missing)],
        ["train", "--no_such_flag", "1"],
        ["train", "configs/tiny.yaml", "--learning_rate", "-1"],
        ["train", "configs/paper-300m.yaml"],
        ["train", "configs/paper-300m.yaml", "--variant", "Q-K=V", "--help"],
    )
    recipe, flag, rate, no_variant, helped = report["calls"]
    assert recipe["code"] == 2 and recipe["err"].startswith("qkvshare train: error: ") and str(missing) in recipe["err"]
    assert flag["code"] == 2 and "--no_such_flag" in flag["err"]
    assert rate == {
        "code": 2,
        "out": "",
        "err": "qkvshare train: error: --learning_rate -1.0 is out of range; it must be > 0, e.g. 3e-4.\n",
    }
    assert no_variant["code"] == 2
    assert "'outputs/paper-300m-{variant}' after the variant, but no --variant is given" in no_variant["err"]
    assert helped["code"] == 0 and "{variant} is replaced by --variant" in " ".join(helped["out"].split())
    assert report["loaded"] == [] and report["qkvshare_modules"] == []


def test_analysis_bad_input_answered_before_torch():
    report = run_fresh(
        ["costs", "--preset", "tiny", "--override", "hidden_size"],
        ["bench", "--repeats", "0"],
        ["compare", "--logging_steps", "5"],
    )
    costs, bench, compare = report["calls"]
    assert costs["code"] == 2 and costs["err"].startswith("qkvshare costs: error: --override item 'hidden_size'")
    assert bench == {
        "code": 2,
        "out": "",
        "err": "qkvshare bench: error: --new_tokens, --repeats and the --train_* sizes must be positive.\n",
    }
    assert compare["code"] == 2 and "--logging_steps is set by compare itself per variant" in compare["err"]
    assert report["loaded"] == []


# ---------------------------------------------------------------------------------------------------------------
# one parse, then the command with the parsed arguments
# ---------------------------------------------------------------------------------------------------------------
def test_arguments_are_parsed_once_and_handed_to_the_command(fake_command, capsys):
    import demolog

    assert qkvshare_cli.main(["demo", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: qkvshare demo")
    assert qkvshare_cli.main(["demo", "--n", "x"]) == 2
    assert "invalid int value: 'x'" in capsys.readouterr().err
    assert qkvshare_cli.main(["demo", "--n", "-1"]) == 2
    assert capsys.readouterr().err == "qkvshare demo: error: --n must be >= 0, got -1\n"
    assert demolog.runs == [] and demolog.inits == []  # the command never ran, its packages never initialised
    assert qkvshare_cli.main(["demo", "--n", "3"]) == 3  # the command's outcome is the exit status
    assert capsys.readouterr().err == "qkvshare demo: stopped: stopped at 3\n"
    assert demolog.parses == [["--help"], ["--n", "x"], ["--n", "-1"], ["--n", "3"]]  # once per call
    assert [vars(args) for args in demolog.runs] == [{"n": 3, "plot": False, "broken": False, "require": False}]
    assert demolog.inits == ["democmd", "democmd.sub"]


# ---------------------------------------------------------------------------------------------------------------
# item 1: extras
# ---------------------------------------------------------------------------------------------------------------
def test_missing_extra_stops_train_before_torch():
    report = run_fresh(["train", "configs/tiny.yaml"], blocked=("accelerate",))
    (call,) = report["calls"]
    assert call["code"] == 2 and call["out"] == ""
    assert call["err"] == (
        "qkvshare train: error: The package accelerate, needed by this command, is not installed. Install the "
        '\'train\' extra: pip install "qkvshare[train]" (in a source checkout: pip install -e ".[train]").\n'
    )
    assert "torch" not in report["loaded"]


def test_missing_extra_names_every_missing_package_of_eval():
    report = run_fresh(["eval", "outputs/some-model"], blocked=("lm_eval", "datasets"))
    (call,) = report["calls"]
    assert call["code"] == 2
    assert "The packages lm-eval and datasets, needed by this command, are not installed" in call["err"]
    assert 'pip install "qkvshare[eval]"' in call["err"]
    assert report["loaded"] == []


def test_extras_checked_at_dispatch_before_the_command_runs(fake_command, monkeypatch, capsys):
    import demolog

    monkeypatch.setitem(COMMANDS, "demo", fake_command._replace(extras=("plots",)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert qkvshare_cli.main(["demo"]) == 2
    assert capsys.readouterr().err == f"qkvshare demo: error: {plots_message('this command')}\n"
    monkeypatch.setitem(COMMANDS, "demo", fake_command._replace(extras=("train", "plots")))
    monkeypatch.setitem(sys.modules, "accelerate", None)
    assert qkvshare_cli.main(["demo"]) == 2  # every missing extra in one message
    train = "The package accelerate, needed by this command, is not installed. Install the 'train' extra: "
    err = capsys.readouterr().err
    assert err.startswith(f"qkvshare demo: error: {train}") and err.endswith(f"). {plots_message('this command')}\n")
    assert demolog.runs == [] and demolog.inits == []
    assert qkvshare_cli.main(["demo", "--help"]) == 0  # help still works without the extra


def test_missing_optional_import_inside_a_command_is_one_message(fake_command, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert qkvshare_cli.main(["demo", "--plot"]) == 2  # a raw `import matplotlib`
    assert capsys.readouterr().err == f"qkvshare demo: error: {plots_message('this command')}\n"
    assert qkvshare_cli.main(["demo", "--require"]) == 2  # through the library helper: its own wording
    assert capsys.readouterr().err == f"qkvshare demo: error: {plots_message('the demo plot', 'or pass --no_plot')}\n"
    with pytest.raises(ModuleNotFoundError, match="no_such_module_anywhere"):  # not an extra: a real bug
        qkvshare_cli.main(["demo", "--broken"])


def test_require_and_check_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError) as info:
        require("matplotlib.pyplot", "plots", "qkvshare bench's plots")
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "matplotlib"
    assert str(info.value) == plots_message("qkvshare bench's plots")
    assert extras.missing_packages("plots") == ["matplotlib"]
    with pytest.raises(MissingExtraError, match=r"^The package matplotlib, needed by the figures, .*qkvshare\[plots\]"):
        check_extra("plots", "the figures")
    with pytest.raises(ValueError, match="'yaml' is not in the 'plots' extra"):
        require("yaml", "plots", "x")
    with pytest.raises(ValueError, match="unknown extra 'plot'; the extras are train, eval, plots, wandb"):
        check_extra("plot", "x")
    # The package is there but one of its own dependencies is not: report that, not a missing extra.
    write_package(tmp_path, {"fakeplot/__init__.py": "import fakeplot_dependency_xyz\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRAS, "fake", {"fakeplot": "fakeplot"})
    with pytest.raises(ModuleNotFoundError) as info:
        require("fakeplot", "fake", "x")
    assert type(info.value) is ModuleNotFoundError and info.value.name == "fakeplot_dependency_xyz"
    assert extras.missing_packages("fake") == []


def test_extras_match_pyproject():
    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements}

    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert names(extras[extra]) == set(modules.values()), extra
    assert extras["all"] == ["qkvshare[train,eval,plots]"]
    assert (
        names(extras["dev"]) == {"qkvshare", "pytest", "pytest-xdist", "ruff", "import-linter", "peft", "transformers"}
        and "qkvshare[all]" in extras["dev"]
    )
    from qkvshare.compat_qkvshare import TESTED_TRANSFORMERS

    assert f"transformers{TESTED_TRANSFORMERS}" in extras["dev"]  # the tests run on the tested release range
    assert names(PYPROJECT["project"]["dependencies"]) == {"torch", "transformers", "safetensors"}
    for name, command in COMMANDS.items():
        assert set(command.extras) <= set(EXTRAS), name


def _third_party_imports(path: Path) -> list[tuple[str, int]]:
    """(top-level module, line) of every absolute import in a file, at any depth, minus stdlib and our own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops = [alias.name.partition(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module.partition(".")[0]]
        else:
            continue
        found += [(top, node.lineno) for top in tops if top not in sys.stdlib_module_names]
    return [(top, line) for top, line in found if top != "__future__"]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Imported only when installed, by no command: qkvshare/__init__.py registers PEFT's default LoRA targets for
# model_type "qkvshare" when peft is there (peft is in the dev extra for its tests).
OPTIONAL_INTEGRATIONS = {"peft"}


def test_every_third_party_import_is_declared():
    """Model files need only the core; every other import is the core's, an extra's, or what those install."""
    distributions = importlib.metadata.packages_distributions()

    def name_of(requirement: str) -> str:
        return _normalize(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])

    def with_their_requirements(names: set[str]) -> set[str]:
        """The distributions and what each always installs (transformers -> pyyaml, tqdm, numpy, ...)."""
        out = set(names)
        for name in names:
            try:
                out |= {name_of(r) for r in importlib.metadata.requires(name) or () if "extra ==" not in r}
            except importlib.metadata.PackageNotFoundError:  # an extra that is not installed here (wandb)
                pass
        return out

    project = PYPROJECT["project"]
    core = with_their_requirements({name_of(r) for r in project["dependencies"]})
    extras = with_their_requirements({_normalize(p) for modules in EXTRAS.values() for p in modules.values()})
    assert set(OPTIONAL_INTEGRATIONS) <= {name_of(r) for r in project["optional-dependencies"]["dev"]}

    def providers(module: str) -> set[str]:
        declared = {_normalize(p) for modules in EXTRAS.values() for m, p in modules.items() if m == module}
        return {_normalize(d) for d in distributions.get(module, ())} | declared

    files = [
        f
        for package in ("qkvshare", "qkvshare_cli", "qkvshare_settings")
        for f in sorted((ROOT / package).rglob("*.py"))
    ]
    assert len(files) > 20
    problems = []
    for path in files:
        model_file = path.parent == ROOT / "qkvshare" and path.stem in MODEL_FILES
        allowed = core if model_file else core | extras | OPTIONAL_INTEGRATIONS
        for module, line in _third_party_imports(path):
            if module in ("qkvshare", "qkvshare_cli", "qkvshare_settings"):
                continue
            if not providers(module) & allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} ({sorted(providers(module))})")
    assert problems == []


def test_command_line_package_imports_only_the_standard_library_and_yaml():
    """What `qkvshare --help` and every parser may import: importing the package or torch there, even in a branch
    the fresh-interpreter tests do not take, would make argument errors wait for torch. (`qkvshare_cli` imports the
    library only through the command table's strings, once a command runs.)"""
    for package, allowed in (
        ("qkvshare_cli", {"yaml", "qkvshare_cli", "qkvshare_settings"}),
        ("qkvshare_settings", {"yaml", "qkvshare_settings"}),
    ):
        imports = {module for path in (ROOT / package).rglob("*.py") for module, _ in _third_party_imports(path)}
        assert imports <= allowed, package


# ---------------------------------------------------------------------------------------------------------------
# one version
# ---------------------------------------------------------------------------------------------------------------
def test_one_version_source():
    import qkvshare
    from qkvshare.version import __version__

    assert "version" not in PYPROJECT["project"] and PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qkvshare.version.__version__"}
    tree = ast.parse((ROOT / "qkvshare/version.py").read_text())  # setuptools reads a literal statically
    literals = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]
    assert literals == [__version__] and re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert qkvshare.__version__ == __version__


# ---------------------------------------------------------------------------------------------------------------
# CI, .gitignore
# ---------------------------------------------------------------------------------------------------------------
CI_SUCCESS = [
    "python -m pip install --quiet --upgrade pip",
    "pip install torch==2.13.0",
    "pip install -e .[dev]",
    "python -m pytest -q -n 2 --dist loadfile",
    "ruff check .",
    "ruff format --check .",
    "lint-imports",
]


def _shim(path: Path, name: str, then: str = "") -> None:
    """A fake `name` that logs its arguments, fails when they are $CI_FAIL, else runs `then`."""
    path.write_text(
        f'#!/usr/bin/env bash\ncall="{name}${{*:+ $*}}"\necho "$call" >> "$CI_LOG"\n[ "$call" = "$CI_FAIL" ] && exit 1\n'
        f"{then}\nexit 0\n"
    )
    path.chmod(0o755)


@pytest.mark.parametrize(
    ("fail", "status", "calls"),
    [
        (None, 0, CI_SUCCESS),
        ("python -m pytest -q -n 2 --dist loadfile", 1, CI_SUCCESS),
        ("ruff check .", 1, CI_SUCCESS),
        ("ruff format --check .", 1, CI_SUCCESS),
        ("lint-imports", 1, CI_SUCCESS),
        ("pip install -e .[dev]", 1, CI_SUCCESS[:3]),
    ],
)
def test_ci_script_fails_when_any_step_fails(tmp_path, fail, status, calls):
    """`.ci/run` with python3, pip, python and ruff replaced by logging shims; `fail` is the step that fails."""
    repo, shims = tmp_path / "repo", tmp_path / "shims"
    venv = repo / ".venv"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci/run").write_text((ROOT / ".ci/run").read_text())
    shims.mkdir()
    # `python3 -m venv .venv` gives pip and python; the dev extra (`pip install -e .[dev]`) brings ruff.
    _shim(shims / "ruff", "ruff")
    _shim(shims / "lint-imports", "lint-imports")
    _shim(shims / "python", "python")
    _shim(
        shims / "pip",
        "pip",
        f'[ "$*" = "install -e .[dev]" ] && cp {shims}/ruff {shims}/lint-imports {venv}/bin/',
    )
    (shims / "bin").mkdir()
    _shim(
        shims / "bin/python3",
        "python3",
        f"mkdir -p {venv}/bin && cp {shims}/pip {shims}/python {venv}/bin/ && "
        f"printf 'export VIRTUAL_ENV={venv}\\nexport PATH={venv}/bin:$PATH\\n' > {venv}/bin/activate",
    )
    env = {**os.environ, "PATH": f"{shims}/bin:/usr/bin:/bin", "CI_LOG": str(tmp_path / "log"), "CI_FAIL": fail or ""}
    proc = subprocess.run(["bash", str(repo / ".ci/run")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert (tmp_path / "log").read_text().splitlines() == ["python3 -m venv .venv", *calls]
    assert ("ruff or lint-imports is not in" in proc.stderr) == (fail == "pip install -e .[dev]")


def test_default_outputs_are_ignored_by_git():
    sources = "\n".join(p.read_text() for p in (ROOT / "qkvshare_settings").rglob("*.py"))
    defaults = set(re.findall(r"""["']--output_dir["'],\s*default=["']([^"']+)["']""", sources))
    defaults |= set(re.findall(r"""\boutput_dir(?:: str =|=)\s*(?:field\(\s*default=)?["']([^"']+)["']""", sources))
    defaults |= {
        m for p in (ROOT / "configs").rglob("*.yaml") for m in re.findall(r"^output_dir: (\S+)", p.read_text(), re.M)
    }
    assert {"eval_results", "outputs/bench", "outputs/compare", "outputs/synthetic", "outputs/cpu-small"} <= defaults
    paths = [f"{d}/file" for d in sorted(defaults)] + ["runs/events", "wandb/run"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == sorted(paths)
