"""The README and the pages under docs/ held to what they show, so that the front door cannot drift: every command
block runs as a user runs it (in a workspace of its own: make's artifacts there, placeholders replaced by what the
tests built), and the set-up commands' output has the shape the README shows; every Python block runs there; every
make target and every command-line flag they name exists. The README stays a first screen (short, nothing dated),
and every relative link of the documentation resolves inside the repository, anchors included."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_released_checkpoint import write_released
from test_serve import free_socket

REPO = Path(__file__).resolve().parent.parent
README_PAGE = REPO / "README.md"
README = README_PAGE.read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))  # the topics the README's map links to
SHOWN = [README_PAGE, *DOCS]  # pages whose blocks run and whose commands are checked, the README first
SHOWN_TEXT = "\n".join(page.read_text() for page in SHOWN)
# pages whose links are checked (besides every tracked .md): a new page is checked before it is committed
LINKED = [*SHOWN, REPO / "CHANGELOG.md", REPO / "bench" / "README.md"]
README_LINES = 150  # the README is a first screen; the long sections live in docs/
DATED = re.compile(r"20\d\d-\d\d-\d\d|\bissues? #?\d+", re.IGNORECASE)  # history, which CHANGELOG.md holds
BIN = Path(sys.executable).parent
SHOWN_PORT = "127.0.0.1:8000"  # where the README's clients find a server
RELEASED_FOLDER = "/path/to/fox-pro-760m-longcrawl64-48b"  # the README's placeholder for a released folder
# make targets a test run does not run itself, and why: they are dry-run (`make -n`) instead
DRY_RUN = {
    "test": "it would run this suite inside itself",
    "lm-eval": "tests/test_lm_eval.py runs the same harness on fox-py document by document",
    "wheel": "it compiles the operator twice; .ci/run's `make wheel-check` builds, installs and runs the wheel",
}
SERVERS = ("kvg-serve", "make serve")  # commands that serve until stopped
NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?"
PROGRESS_LINE = re.compile(r"^\S+ +\.\.\. \d+ s: ")  # a long stage's progress (exporters/progress.py), timing's


def fenced(text: str) -> list[tuple[str, str]]:
    """A page's fenced blocks as (language, body), in order; "" is a plain block's language."""
    found, opened, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if not line.startswith("```"):
            lines.append(line)
        elif opened is None:
            opened, lines = line[3:].strip(), []
        else:
            found.append((opened, "".join(lines)))
            opened = None
    return found


def blocks(language: str, pages: list[Path] = SHOWN) -> list[str]:
    """The fenced blocks of `language` ("" for plain ones) on `pages`, page by page (the README first), in order."""
    return [body for page in pages for opened, body in fenced(page.read_text()) if opened == language]


def commands(block: str) -> list[str]:
    """A command block's commands: one a line, comments dropped, `&&` chains split."""
    found = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


def shape(shown: str) -> re.Pattern:
    """What an output block shows, with its numbers and spacing free, a line of `...` any lines, and `...` within a
    line anything. Which cache tensor is worst at a step is free too: among values a few float32 units apart it
    changes with the CPU's rounding (present.2.key on one machine, present.2.value on another)."""
    lines = []
    for line in shown.strip("\n").splitlines():
        if line.strip() == "...":
            lines.append(r"(?:.*\n)*?")
            continue
        pattern = re.escape(line).replace(r"\.\.\.", ".*")
        pattern = re.sub(r"(?:\\ )+", " +", pattern)
        pattern = re.sub(r"present\\\.\d+\\\.[a-z_]+", lambda _: r"present\.\d+\.[a-z_]+", pattern)
        pattern = re.sub(r"\d+(?:\\\.\d+)?(?:e\\-\d+)?", lambda _: NUMBER, pattern)
        lines.append(pattern + r"\n")
    return re.compile("".join(lines))


def shown_output(first_word: str) -> re.Pattern:
    """The README's own output block that starts with `first_word` (a page under docs/ may show others)."""
    return shape(next(block for block in blocks("", [README_PAGE]) if block.startswith(first_word)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Where the README's commands and blocks run: make writes its artifacts here, `models` is the repository's,
    and the released-checkpoint placeholder names a folder laid out as the released ones."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "models").symlink_to(REPO / "models")
    write_released(folder / "released")
    return folder


def shell(command: str, workspace: Path) -> str:
    """`command` as the README writes it, run here: make against the repository with its artifacts in the workspace,
    placeholders replaced."""
    command = command.replace(RELEASED_FOLDER, str(workspace / "released"))
    if command.startswith("make "):
        command = f"make -s -C {REPO} --no-print-directory ARTIFACTS={workspace / 'artifacts'} {command[5:]}"
    return command


def run(command: str, workspace: Path, timeout: int = 600) -> str:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(["bash", "-c", command], cwd=workspace, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout}"
    output = done.stdout.replace(f"{workspace}/", "")
    return "".join(line + "\n" for line in output.splitlines() if not PROGRESS_LINE.match(line))


def serve(command: str, workspace: Path) -> tuple[subprocess.Popen, str]:
    """Start a serving command on a free port; returns the process and its base URL once it is healthy."""
    port = free_socket().getsockname()[1]  # closed again at once; the server binds it itself
    flag = f"SERVE_FLAGS='--port {port}'" if command.startswith("make ") else f"--port {port}"
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    process = subprocess.Popen(["bash", "-c", f"exec {shell(command, workspace)} {flag}"], cwd=workspace, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        assert process.poll() is None, f"{command} ended: {process.stderr.read().decode()}"
        assert time.monotonic() < deadline, f"{command} did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(60)


def run_python(block: str, workspace: Path, url: str | None = None) -> None:
    if url is not None:
        block = block.replace(f"http://{SHOWN_PORT}", url)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", block], cwd=workspace, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{block}\n{done.stderr}"


def test_the_set_up_commands_run_and_print_what_the_readme_shows(workspace):
    assert blocks("sh")[0] == blocks("sh", [README_PAGE])[0]  # the next test runs every command block but this one
    setup = commands(blocks("sh")[0])
    assert setup == ["make export MODEL=fox-py", "make generate MODEL=fox-py", "make test"]
    exported = run(shell(setup[0], workspace), workspace)
    assert shown_output("load ").match(exported), exported
    generated = run(shell(setup[1], workspace), workspace)
    assert shown_output("kvg-generate: ").fullmatch(generated), generated
    run(shell("make -n test", workspace), workspace)  # the target and its command exist; it is this suite


def test_every_other_command_block_runs_and_its_clients_talk_to_its_servers(workspace):
    """Each block's commands in order, the README's and docs/'s; a server is started, answers a text prompt, the
    pages' Python clients of the model it serves run against it, and it is stopped."""
    clients = [block for block in blocks("python") if SHOWN_PORT in block]
    curls = [block for block in blocks("sh") if f"curl -sf http://{SHOWN_PORT}" in block]  # run whole, `set -e`
    assert clients and curls, "the documentation shows clients of kvg-serve, in Python and with curl"
    served = []
    for block in blocks("sh")[1:]:
        for command in [] if block in curls else commands(block):
            target = command.split()[1] if command.startswith("make ") else None
            if target in DRY_RUN:
                run(shell(command.replace("make ", "make -n ", 1), workspace), workspace)
            elif command.startswith(SERVERS):
                process, url = serve(command, workspace)
                try:
                    name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                    body = {"model": name, "prompt": "def main():", "max_tokens": 8}
                    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
                    for client in clients:
                        if f'model="{name}"' in client:
                            run_python(client, workspace, url)
                            served.append(client)
                    for curl in curls:
                        if name in curl:
                            run("set -e\n" + curl.replace(f"http://{SHOWN_PORT}", url), workspace)
                            served.append(curl)
                finally:
                    stop(process)
            else:
                run(shell(command, workspace), workspace)
    assert sorted(served) == sorted(clients + curls)  # each client ran, against the server of the model it names


def test_every_python_block_runs(workspace):
    """Those that need no server; run after the set-up commands made artifacts/fox-py-dynamic-fp32."""
    if not (workspace / "artifacts" / "fox-py-dynamic-fp32").is_dir():
        run(shell("make export MODEL=fox-py", workspace), workspace)
    for block in blocks("python"):
        if SHOWN_PORT not in block:
            run_python(block, workspace)


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)", SHOWN_TEXT))
    assert named and named <= targets, named - targets


@pytest.mark.parametrize("command", ["kvg-export", "kvg-generate", "kvg-serve", "kvg-eval", "kvg-lm-eval"])
def test_every_flag_the_readme_names_for_a_command_is_one_it_takes(command):
    spans = re.findall(rf"`{command} ([^`]*)`", SHOWN_TEXT) + [
        line for block in blocks("sh") for line in commands(block) if line.startswith(command)
    ]
    named = {flag for span in spans for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", span)}
    taken = set(re.findall(r"--[a-z][a-z-]*", run(f"{command} --help", REPO)))
    assert spans and named <= taken, sorted(named - taken)


def test_a_block_is_what_the_commands_parse(workspace):
    """The parser itself: a chained line splits, comments go, placeholders and make are rewritten."""
    assert commands("a && b   # c\n\nd\n") == ["a", "b", "d"]
    assert shell(f"kvg-export {RELEASED_FOLDER}", workspace) == f"kvg-export {workspace / 'released'}"
    assert shlex.split(shell("make export MODEL=x", workspace))[:4] == ["make", "-s", "-C", str(REPO)]
    assert shape("load   0.0 s  x ...\n...\nend").fullmatch("load 12.5 s  x and y\na\nb\nend\n")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped, spaces as hyphens, a repeat
    numbered."""
    found, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).splitlines():  # a `#` in a block is no heading
        heading = re.match(r"#{1,6} +(.+?)[ #]*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def link_target(page: Path, link: str) -> Path:
    """Where a relative link leads: from the page's folder, or from the repository's root when it starts with `/`
    (as GitHub reads it), so that a page under docs/ reaches bench/README.md without `../`."""
    path = link.partition("#")[0]
    return (REPO / path.lstrip("/") if path.startswith("/") else page.parent / path).resolve()


def documentation_pages() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return sorted({*(REPO / name for name in tracked.stdout.split()), *(page for page in LINKED if page.exists())})


def test_every_relative_link_in_the_documentation_resolves_inside_the_repository():
    """A clean clone is all a reader has: a link (or a path written as a sibling's, `../...`) that leaves the
    repository, names a file it lacks, or a heading the page lacks, is a dead end."""
    pages = documentation_pages()
    assert set(LINKED) <= set(pages), sorted(map(str, set(LINKED) - set(pages)))
    checked = 0
    for page in pages:
        name, text = page.relative_to(REPO), page.read_text()
        assert not re.findall(r"\.\./[\w.-]+", text), f"{name} points outside the repository"
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # a web address
                continue
            target = page if link.startswith("#") else link_target(page, link)
            assert target.is_relative_to(REPO) and target.exists(), f"{name} links to {link}, which is not there"
            anchor = link.partition("#")[2]
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target.read_text()), f"{name} links to {link}: no such heading"
            checked += 1
    assert checked, "the documentation links nowhere"


def test_a_link_check_tells_good_links_from_dead_ones():
    """The checker itself: a root link and a page's own anchors resolve, headings get GitHub's anchors."""
    assert link_target(REPO / "docs" / "x.md", "/bench/README.md#summary") == REPO / "bench" / "README.md"
    assert link_target(REPO / "README.md", "docs/pruning.md") == REPO / "docs" / "pruning.md"
    assert not link_target(REPO / "docs" / "x.md", "README.md").exists()  # a sibling, not the root's
    found = anchors("# The API: `make x`\n## The API: `make x`\n```sh\n# a comment\n```\n### Long, long context\n")
    assert found == {"the-api-make-x", "the-api-make-x-1", "long-long-context"}


def test_the_readme_is_a_first_screen_with_nothing_dated():
    """What the project is, the two commands and the map: the long sections are in docs/ and the dated history in
    CHANGELOG.md, so the README and the docs state what is true now."""
    lines = README.splitlines()
    assert len(lines) < README_LINES, f"README.md has {len(lines)} lines; move sections into docs/"
    for page in SHOWN:
        dated = [(number, line) for number, line in enumerate(page.read_text().splitlines(), 1) if DATED.search(line)]
        assert not dated, f"{page.relative_to(REPO)} is dated (CHANGELOG.md holds history): {dated}"
    assert DATED.search("measured on 2026-12-05") and DATED.search("issue 31 measured")  # the pattern bites
    assert DATED.search((REPO / "CHANGELOG.md").read_text()), "CHANGELOG.md holds the dated history"


def test_the_readme_map_links_every_docs_page_and_every_block_is_one_the_tests_run():
    """No page under docs/ is out of the map's reach, and no fenced block escapes running: a command block is `sh`,
    code is `python`, and a plain block is output the reader compares with."""
    assert DOCS, "docs/ holds the README's long sections"
    linked = {link_target(README_PAGE, link) for link in re.findall(r"\]\(([^)\s#]+)[^)\s]*\)", README)}
    assert set(DOCS) <= linked, sorted(page.name for page in set(DOCS) - linked)
    for page in SHOWN:
        languages = {language for language, _ in fenced(page.read_text())}
        assert languages <= {"sh", "python", ""}, f"{page.relative_to(REPO)}: blocks in {languages} would not run"
