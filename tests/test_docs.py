"""Every code block of README.md, BENCHMARKS.md and docs/ runs, or says why it does not.

The convention of the pages: a ```bash or ```python block is executed; ```text is sample output
(``yaml``, ``json`` and ``toml`` blocks are data shown on the page) and is not run, except a
shown refusal: a ```text block of exactly ``$ jaxpar ...`` and one ``jaxpar VERB: error: ...``
line is run at its place on the page and must exit 2 printing that line alone. A block whose
previous non-blank line is ``<!-- not-run: REASON -->`` is not run (installs, multi-minute jobs,
GPU-only commands), and the reason may not be empty. Any other fence (no language, an unknown
one) fails, so nothing on a page is skipped silently.

Each page runs in its own temporary directory, kept across its blocks, so a page can build on its
earlier blocks (a corpus, then a token file, then a checkpoint). Bash blocks run under
``bash -euo pipefail``; python blocks as scripts in a fresh interpreter. Both find this tree first
on ``PYTHONPATH``, ``jaxpar`` and ``python`` on ``PATH`` mean this tree's CLI and this
interpreter, and ``scripts/``, ``models/``, ``meshes/`` and ``notebooks/`` are linked into the
directory, so a page's commands read as they are typed at the repository root. Children get the
suite's XLA -O0 flag (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent
RUN = ("bash", "python")
SHOWN = ("text", "yaml", "json", "toml")
LINKED = ("scripts", "models", "meshes", "notebooks")
NOT_RUN = re.compile(r"^<!--\s*not-run\s*(?::(?P<reason>.*?))?\s*-->$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^`\s]*)\s*$")
TIMEOUT_S = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REFUSAL = re.compile(r"\$ (?P<cmd>jaxpar [^\n]+)\n(?P<line>jaxpar [a-z-]+: error: [^\n]+)\n")


class PageError(ValueError):
    """A page breaks the code-block convention (the message names file and line)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the marker's reason, None when the block is not marked

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.not_run is None

    @property
    def refusal(self) -> tuple[str, str] | None:
        """``(command, error line)`` of a shown refusal that is checked (module docstring)."""
        m = REFUSAL.fullmatch(self.code) if self.lang == "text" and self.not_run is None else None
        return (m.group("cmd"), m.group("line")) if m else None


def parse(text: str, path: str = "<page>") -> list[Block]:
    """The page's fenced blocks, checked against the convention; raises :class:`PageError`."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        marker = NOT_RUN.match(stripped)
        if marker:
            reason = (marker.group("reason") or "").strip()
            if not reason:
                raise PageError(f"{path}:{i + 1}: not-run marker without a reason")
            pending = (i + 1, reason)
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if fence:
            lang, start = fence.group("lang"), i
            if lang not in RUN + SHOWN:
                raise PageError(
                    f"{path}:{i + 1}: code block language {lang or '(none)'!r}: must be one of "
                    f"{', '.join(RUN + SHOWN)}"
                )
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(fence.group("indent")) :])
                i += 1
            if i == len(lines):
                raise PageError(f"{path}:{start + 1}: code block never closed")
            reason = pending[1] if pending else None
            blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", reason))
            pending = None
        elif stripped and pending:
            raise PageError(f"{path}:{pending[0]}: not-run marker not followed by a code block")
        i += 1
    if pending:
        raise PageError(f"{path}:{pending[0]}: not-run marker not followed by a code block")
    return blocks


def pages() -> list[Path]:
    """README.md, BENCHMARKS.md and every page under docs/."""
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if p.exists()]


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(dict.fromkeys([*flags, TEST_XLA_FLAGS]))
    env["COLUMNS"] = "100"
    return env


def _workdir(tmp: Path) -> tuple[Path, Path]:
    """The page's directory (repository folders linked in) and a bin/ of this tree's commands."""
    work, bin_dir = tmp / "page", tmp / "bin"
    work.mkdir()
    bin_dir.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name, target_is_directory=True)
    (bin_dir / "jaxpar").write_text(
        f"#!/bin/sh\nexec {sys.executable} -c "
        "'import sys; from jaxpar.cli import main; sys.exit(main())' \"$@\"\n"
    )
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return work, bin_dir


def run_block(block: Block, work: Path, env: dict[str, str]) -> None:
    """Run one block in ``work``; fail with its source location and output when it fails."""
    __tracebackhide__ = True  # the failure message says it all (and the env stays out of logs)
    if block.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        script = work / f"_block_{block.line}.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    try:
        out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.path}:{block.line}: {block.lang} block ran over {TIMEOUT_S} s")
    if out.returncode != 0:
        pytest.fail(
            f"{block.path}:{block.line}: {block.lang} block exited {out.returncode}\n"
            f"--- block\n{block.code}--- stdout (tail)\n{out.stdout[-3000:]}\n"
            f"--- stderr (tail)\n{out.stderr[-3000:]}"
        )


def check_refusal(block: Block, work: Path, env: dict[str, str]) -> None:
    """Run a shown refusal's command in ``work``: exit 2, its error line alone on stderr."""
    __tracebackhide__ = True
    cmd, line = block.refusal or ("", "")
    out = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)  # fmt: skip
    if out.returncode != 2 or out.stdout or out.stderr.splitlines() != [line]:
        pytest.fail(
            f"{block.path}:{block.line}: the refusal shown is not what `{cmd}` does (exit "
            f"{out.returncode})\n--- shown\n{line}\n--- stdout (tail)\n{out.stdout[-3000:]}\n"
            f"--- stderr (tail)\n{out.stderr[-3000:]}"
        )


PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path):
    """Every runnable block of the page exits 0, and every shown refusal is what its command
    prints, in order, in one directory."""
    blocks = parse(page.read_text(), str(page.relative_to(ROOT)))
    runnable = [b for b in blocks if b.runs or b.refusal]
    if not runnable:
        return  # a page of prose, tables and marked blocks: parse() has checked its markers
    work, bin_dir = _workdir(tmp_path)
    env = _env(bin_dir)
    for block in runnable:
        if block.refusal:
            check_refusal(block, work, env)
        else:
            run_block(block, work, env)


def test_not_run_reasons_name_tests_that_exist():
    """A reason that names ``tests/test_x.py[::name]`` names a file and test that exist."""
    named = re.compile(r"tests/(test_\w+\.py)(?:::(\w+))?")
    for page in PAGES:
        for block in parse(page.read_text(), str(page)):
            for file, name in named.findall(block.not_run or ""):
                source = ROOT / "tests" / file
                assert source.exists(), f"{block.path}:{block.line}: no tests/{file}"
                if name:
                    assert re.search(rf"^def {name}\(", source.read_text(), re.M), (
                        f"{block.path}:{block.line}: tests/{file} has no test {name}"
                    )


def test_readme_keeps_the_two_commands_and_runs_the_default_training():
    """The README's two commands stay verbatim; a run block trains with every default."""
    blocks = parse((ROOT / "README.md").read_text(), "README.md")
    codes = [b.code.strip() for b in blocks]
    assert "python3 -m pip install -e . && jaxpar train" in codes
    suite = "python3 -m pytest tests -n 2 --dist loadfile"
    assert f'python3 -m pip install -e ".[test]" && {suite}' in codes
    assert suite in (ROOT / ".ci" / "run").read_text()
    default = re.compile(r"^jaxpar train --steps \d+$", re.M)
    assert any(b.runs and default.search(b.code) for b in blocks), (
        "README.md: no executed block runs `jaxpar train --steps N` (the defaults)"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- not-run -->\n```bash\nexit 1\n```\n", "without a reason"),
        ("<!-- not-run:   -->\n```bash\nexit 1\n```\n", "without a reason"),
        ("<!-- not-run: slow -->\n\nSome prose.\n```bash\nexit 1\n```\n", "not followed"),
        ("<!-- not-run: slow -->\n", "not followed"),
        ("```\nls\n```\n", "language '(none)'"),
        ("```sh\nls\n```\n", "language 'sh'"),
        ("```bash\nls\n", "never closed"),
    ],
)
def test_parse_refuses_pages_that_break_the_convention(text, message):
    with pytest.raises(PageError, match=re.escape(message)):
        parse(text)


def test_parse_reads_languages_and_markers():
    text = (
        "```bash\necho a\n```\n<!-- not-run: installs a package -->\n\n```bash\npip x\n```\n"
        "```text\n$ out\n```\n  ```python\n  print(1)\n  ```\n"
    )
    blocks = parse(text)
    assert [(b.lang, b.runs, b.not_run) for b in blocks] == [
        ("bash", True, None),
        ("bash", False, "installs a package"),
        ("text", False, None),
        ("python", True, None),
    ]
    assert blocks[3].code == "print(1)\n" and blocks[0].line == 1
    shown = "```text\n$ jaxpar train --dp 3\njaxpar train: error: layout: bad\n```\n"
    assert parse(shown)[0].refusal == ("jaxpar train --dp 3", "jaxpar train: error: layout: bad")
    assert parse("<!-- not-run: needs a GPU -->\n" + shown)[0].refusal is None
    assert parse(shown.replace("$ ", ""))[0].refusal is None  # sample output, not a refusal


def test_a_script_without_simulated_devices_is_told_how_to_get_them(tmp_path):
    """The library example without ``simulate_cpu_devices``: one error that names it."""
    script = tmp_path / "no_devices.py"
    script.write_text(
        "from jaxpar import config as C\n"
        "from jaxpar.errors import ConfigError\n"
        "from jaxpar.train.loop import run\n"
        "cfg = C.load('tiny', 'cpu-8')\n"
        "try:\n"
        "    run(cfg, quiet=True)\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "must equal the number of devices JAX sees (1)" in out.stdout
    assert "jaxpar.devices.simulate_cpu_devices(8) in Python" in out.stdout


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_relative_links_reach_files_and_headings():
    """Every relative link of a page names a file of the tree and, after ``#``, one of its
    headings (outside code blocks)."""
    for page in PAGES:
        text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            assert dest.exists(), f"{page.relative_to(ROOT)}: broken link {target} ({rel})"
            if anchor:
                heads = re.findall(r"^#+ (.*)$", re.sub(r"^ *```.*?^ *```", "", dest.read_text(),
                                                        flags=re.S | re.M), re.M)  # fmt: skip
                assert anchor in {slug(h) for h in heads}, (
                    f"{page.relative_to(ROOT)}: link {target}: no such heading"
                )
